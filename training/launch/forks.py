"""Training children forked from a zygote (`training.worker.zygote`), seen as subprocess sees
its children.

A process that starts training children (a flow run, a task retried after a preemption, the
next flow run in the same worker, a test session) keeps one zygote: a process that imported
torch and the training loop once. Each single-process job's child is forked from it, so it
skips the imports a fresh Python would pay (about 2.5 s of CPU each). Anything the zygote
cannot vouch for starts a fresh process (subprocess.Popen): torchrun jobs, a machine with a GPU
driver, a parent whose environment changed a variable read at import time, a zygote that died
or refused to serve.

`ForkedProcess` has the part of `subprocess.Popen`'s interface the launcher uses (pid, stdin,
stdout, poll, wait, send_signal, kill, returncode). The zygote reports each exit code; signals
go through a pidfd where Linux has one, so a number reused after the exit is never signalled.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from typing import IO, Protocol

from training.protocol.entries import FORKABLE, ZYGOTE_MODULE
from training.protocol.numerics import gpu_driver_present
from training.protocol.zygote import ZYGOTE_MESSAGE, Exited, Ready, Spawned, SpawnRequest, ZygoteMessage
from training.storage.files import process_alive

__all__ = ["ChildProcess", "ForkedProcess", "start_child"]

# Read when a library loads (OpenMP's thread count, allocator and CUDA settings, torch's own
# flags, Python's): a child whose environment differs in one of them gets a zygote that
# started with it.
_IMPORT_TIME = re.compile(r"^(OMP_|MKL_|KMP_|GOMP_|OPENBLAS_|TORCH|PYTORCH_|CUDA_|NCCL_|NVIDIA_|TRITON_|LD_|"
                          r"MALLOC_|GLIBC_|PYTHON)")
_MAX_MESSAGE = 1 << 20


class ChildProcess(Protocol):
    """What the launcher needs of a child process: subprocess.Popen, or a forked one."""

    pid: int
    stdin: IO[str] | None
    stdout: IO[str] | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


class ForkedProcess:
    """A child forked by the zygote."""

    def __init__(self, args: list[str], pid: int, stdin: IO[str] | None, stdout: IO[str]) -> None:
        self.args, self.pid = args, pid
        self.stdin: IO[str] | None = stdin
        self.stdout: IO[str] | None = stdout
        self.returncode: int | None = None
        self._ended = threading.Event()
        self._pidfd: int | None = None
        with contextlib.suppress(OSError, AttributeError):
            self._pidfd = os.pidfd_open(pid)

    def _exited(self, returncode: int) -> None:
        self.returncode = returncode
        self._ended.set()
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is not None:
            return
        pidfd = self._pidfd
        try:
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, sig)
            else:
                os.kill(self.pid, sig)
        except (ProcessLookupError, OSError):
            pass  # it exited meanwhile

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if _IMPORT_TIME.match(k)}


class _Zygote:
    """One zygote process and the thread that reads what it reports."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env_key = _import_time_env(env)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen([sys.executable, "-m", ZYGOTE_MODULE, str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        self.sock = ours
        self.alive = False
        self._lock = threading.Lock()
        self._children: dict[int, ForkedProcess] = {}
        self._spawned: dict[int, int] = {}
        self._exits: dict[int, int] = {}
        self._replied = threading.Condition()
        self._next_id = 0
        ready = self._receive()
        if not isinstance(ready, Ready):
            self.close()
            return
        self.pid = ready.ready
        self.alive = True
        threading.Thread(target=self._read, daemon=True, name="retrain-zygote").start()

    def _receive(self) -> ZygoteMessage | None:
        try:
            data = self.sock.recv(_MAX_MESSAGE)
        except OSError:
            return None
        return ZYGOTE_MESSAGE.validate_json(data) if data else None

    def _read(self) -> None:
        while (message := self._receive()) is not None:
            if isinstance(message, Spawned):
                with self._replied:
                    self._spawned[message.spawned] = message.pid
                    self._replied.notify_all()
            elif isinstance(message, Exited):
                pid, code = message.exited, message.returncode
                with self._replied:
                    child = self._children.pop(pid, None)
                    if child is None:
                        self._exits[pid] = code  # it ended before its spawner registered it
                if child is not None:
                    child._exited(code)
        # The zygote is gone: its children got SIGTERM (their parent-death signal) and write
        # their emergency checkpoints, but their exit codes went with it. They read as killed
        # by SIGTERM once they are gone: a preemption, which a retry resumes.
        with self._replied:
            self.alive = False
            self._replied.notify_all()
            lost, self._children = list(self._children.values()), {}
        for child in lost:
            threading.Thread(target=_await_lost, args=(child,), daemon=True).start()

    def spawn(self, argv: list[str], env: dict[str, str], hold: bool) -> ForkedProcess | None:
        out_r, out_w = os.pipe()
        in_r, in_w = os.pipe() if hold else (os.open(os.devnull, os.O_RDONLY), -1)
        try:
            with self._lock:
                request_id = self._next_id
                self._next_id += 1
                message = SpawnRequest(spawn=request_id, argv=argv, env=env, cwd=os.getcwd())
                try:
                    socket.send_fds(self.sock, [message.model_dump_json().encode()], [in_r, out_w, 2])
                except OSError:
                    return None
                with self._replied:
                    while request_id not in self._spawned and self.alive:
                        self._replied.wait()
                    pid = self._spawned.pop(request_id, None)
                if pid is None:
                    return None
                child = ForkedProcess(argv, pid, open(in_w, "w", encoding="utf-8") if hold else None,
                                      open(out_r, encoding="utf-8"))
                in_w = out_r = -1  # the files own them now
                with self._replied:
                    code = self._exits.pop(pid, None)
                    if code is None and self.alive:
                        self._children[pid] = child
                if code is not None:
                    child._exited(code)
                elif not self.alive:
                    threading.Thread(target=_await_lost, args=(child,), daemon=True).start()
                return child
        finally:
            for fd in (in_r, out_w, in_w, out_r):
                if fd >= 0:
                    os.close(fd)

    def close(self) -> None:
        """Close the control socket: the zygote exits (idle warm children get SIGTERM)."""
        with contextlib.suppress(OSError):
            # shutdown, not only close: the reader thread's pending recv keeps a closed socket
            # open in the kernel, and the zygote would never see the end.
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


def _await_lost(child: ForkedProcess) -> None:
    pidfd = child._pidfd
    if pidfd is not None:
        import select

        with contextlib.suppress(OSError):
            select.select([pidfd], [], [])
    else:
        import time

        while process_alive(child.pid):
            time.sleep(0.2)
    child._exited(-signal.SIGTERM)


_lock = threading.Lock()
_zygote: _Zygote | None = None


def _zygote_for(env: dict[str, str]) -> _Zygote | None:
    global _zygote
    with _lock:
        if _zygote is not None and (not _zygote.alive or _zygote.env_key != _import_time_env(env)):
            _zygote.close()
            _zygote = None
        if _zygote is None:
            _zygote = _Zygote(env)
        return _zygote if _zygote.alive else None


def _close() -> None:
    global _zygote
    with _lock:
        if _zygote is not None:
            _zygote.close()
            _zygote = None


def _forget_in_forked_child() -> None:
    # A process forked from this one (not exec'd) must not hold the control socket open: the
    # zygote exits when the socket's last holder closes it. Closed, never shut down: shutting
    # down would end the parent's connection too.
    global _zygote
    if _zygote is not None:
        with contextlib.suppress(OSError):
            _zygote.sock.close()
        _zygote = None


atexit.register(_close)
os.register_at_fork(after_in_child=_forget_in_forked_child)


def _forkable(command: list[str]) -> tuple[str, list[str]] | None:
    """(the module, its own arguments) when `command` runs one of the zygote's modules in a
    single process, else None."""
    if len(command) < 3 or command[:2] != [sys.executable, "-m"] or command[2] not in FORKABLE:
        return None
    return command[2], command[3:]


def start_child(command: list[str], env: dict[str, str], stdin_pipe: bool) -> ChildProcess:
    """Start `command` (its stdout piped, in a session of its own): forked from the zygote when
    it runs one of the zygote's modules (a single-process worker, a stage child) on a machine
    without a GPU driver, else a fresh process. Where there is a GPU, a child's CUDA context
    takes longer to start than the imports, and a fresh process can inherit no CUDA state from
    anyone."""
    forkable = _forkable(command)
    if forkable is not None and env.get("RETRAIN_NO_ZYGOTE") != "1" and not gpu_driver_present():
        zygote = _zygote_for(env)
        if zygote is not None:
            # The child checks that its parent lives: the zygote is its parent, and the zygote
            # lives as long as this process holds it.
            module, (job, error, _parent, *rest) = forkable
            child = zygote.spawn([module, job, error, str(zygote.pid), *rest], env, stdin_pipe)
            if child is not None:
                return child
    return subprocess.Popen(command, stdout=subprocess.PIPE, stdin=subprocess.PIPE if stdin_pipe else None,
                            text=True, env=env, start_new_session=True)
