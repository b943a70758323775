"""The zygote: a process that has imported torch and the training loop once, and forks a
training child for each job it is asked for (`training.launch.forks` is its parent's side).

A training child started from nothing spends about 2.5 s of CPU importing Python, torch and
torch._dynamo (which torch.optim imports on its first step) before its first step. A child
forked from the zygote starts with all of it imported. A parent that starts several children
(a task retried after a preemption, a flow run followed by another in the same process) pays
the imports once.

The child is the worker a fresh process would be: the zygote forks before anything has run a
kernel, and it refuses to serve if an import left a second Python thread (a fork copies only
the forking thread). The child then takes its job's environment, working folder, argv and stdin,
stdout and stderr from the request, starts a session of its own, and runs the `main` of the
module its argv names: `training.worker.train`, which seeds every generator from the job, or
`training.worker.stage` (evaluation and export; `training.protocol.entries.FORKABLE`
lists them). Its parent-death
signal points at the zygote, and the zygote exits when its parent closes the control socket,
so a child still gets SIGTERM (and writes its emergency checkpoint) when the task process dies.

Protocol, over a SOCK_SEQPACKET socket pair (one message per send): the zygote says
`{"ready": pid}` once its imports are done; a request is `{"spawn": id, "argv": [...], "env":
{...}, "cwd": path}` with stdin, stdout and stderr passed as file descriptors; the zygote answers
`{"spawned": id, "pid": pid}` and, when the child exits, `{"exited": pid, "returncode": code}`
(negative: the signal that killed it, as subprocess reports it).
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import threading
from typing import NoReturn

from training.protocol.entries import FORKABLE, WORKER_MODULE
from training.protocol.zygote import Exited, Ready, Refused, Spawned, SpawnRequest, ZygoteMessage

__all__ = ["PRELOAD", "main"]

# What a worker imports before its first step; torch._dynamo is imported by torch.optim's first
# step, so the zygote imports it too.
PRELOAD = ("torch", "torch._dynamo", "torch.optim", WORKER_MODULE, "setproctitle")
_MAX_MESSAGE = 1 << 20
_STARTED_IN = os.getcwd()


def _cuda_initialized() -> bool:
    import torch

    return bool(torch.cuda.is_initialized())


def _send(sock: socket.socket, message: ZygoteMessage) -> None:
    sock.send(message.model_dump_json().encode())


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, Exited(exited=pid, returncode=os.waitstatus_to_exitcode(status)))


def _run_child(request: SpawnRequest, fds: list[int], sock: socket.socket, closing: list[int]) -> NoReturn:
    """In the forked child: become the worker a fresh process would be, run it, exit."""
    code = 1
    try:
        os.close(sock.detach())  # detached: the object's finalizer must not close a reused number
        for fd in closing:
            os.close(fd)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        os.setsid()  # its own group, as the parent's Popen(start_new_session=True) gives it
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        import setproctitle

        # ps, top and the OOM killer's log name the job, as they do a fresh worker's. Before the
        # environment changes: setproctitle finds the room for the title next to the original one.
        setproctitle.setproctitle(" ".join([sys.executable, "-m", *request.argv]))
        os.chdir(request.cwd)
        if sys.path and sys.path[0] == _STARTED_IN:
            sys.path[0] = request.cwd  # `python -m` puts the working folder first: a user's factory module may be there
        import importlib

        importlib.invalidate_caches()
        os.environ.clear()
        os.environ.update(request.env)
        sys.argv = list(request.argv)
        sys.stdin = open(0, encoding="utf-8", closefd=False)
        sys.stdout = open(1, "w", encoding="utf-8", buffering=1, closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", buffering=1, closefd=False)
        if sys.argv[0] not in FORKABLE:
            raise ValueError(f"the zygote runs only {FORKABLE}, not {sys.argv[0]!r}")
        code = importlib.import_module(sys.argv[0]).main(sys.argv[1:])
    except SystemExit as ended:
        code = ended.code if isinstance(ended.code, int) else (0 if ended.code is None else 1)
    except BaseException:  # noqa: BLE001 - a bug in the worker: its traceback, then exit 1 as python would
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            import atexit
            import logging

            logging.shutdown()
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main(control_fd: int) -> int:
    sock = socket.socket(fileno=control_fd)
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    if _cuda_initialized():
        _send(sock, Refused(refused="CUDA was initialized by the imports; a forked child could not use it"))
        return 1
    # A fork copies only the forking thread: no Python thread may hold a lock the child needs.
    # The native pools the imports start (OpenBLAS's, jemalloc's) re-arm themselves in a forked
    # child through their own fork handlers, as they do for every DataLoader worker.
    if threading.active_count() != 1:
        _send(sock, Refused(refused=f"{threading.active_count()} Python threads after the imports"))
        return 1
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below through wake_w
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the parent's to pass on
    _send(sock, Ready(ready=os.getpid()))
    try:
        _serve(sock, wake_r, wake_w)
    except OSError:
        pass  # the parent went while we wrote to it: exiting fires the children's parent-death signal
    return 0


def _serve(sock: socket.socket, wake_r: int, wake_w: int) -> None:
    while True:
        readable, _, _ = select.select([sock.fileno(), wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 4096)
            _reap(sock)
        if sock.fileno() not in readable:
            continue
        data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 3)
        if not data:
            return  # the parent is gone: exiting fires the children's parent-death signal
        request = SpawnRequest.model_validate_json(data)
        pid = os.fork()
        if pid == 0:
            _run_child(request, fds, sock, [wake_r, wake_w])
        for fd in fds:
            os.close(fd)
        _send(sock, Spawned(spawned=request.spawn, pid=pid))
        _reap(sock)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
