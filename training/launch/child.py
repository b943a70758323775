"""A training child process seen from its parent: its event lines, its exit, and, for the
short jobs of a tuning study, a pool of children kept warm between jobs.

A fresh child costs about 2.4 s here before its first step (Python, torch, and torch.optim
importing torch._dynamo on first use); a warm one, handed its next job on stdin, starts it in
about 0.01 s (measured on the demo's tuning rungs). That start-up was most of the price of a
rung of a few seconds, so a study keeps up to `tune.concurrency` children warm: a promoted
trial's next rung, or the next trial, runs in a child that already paid it. A job in a warm
child is the same job as in a fresh one: the Trainer is built anew, resumes from the run's
checkpoint and seeds every generator, so which child ran it changes nothing (tested).

Protocol (single-process jobs only; torchrun children are never kept): a child started with
`--hold` writes `{"event": "idle"}` after a job that ended with exit code 0 and waits on stdin
for one JSON line `{"job": "PATH#sha256=HEX", "error": path, "spawn_time": t}` (the job sealed, as on a
command line: `training.protocol.sealed`); end of file, SIGTERM or its
parent's death ends it. Any other ending (preempted, a user error, a crash) exits the process, as without `--hold`.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

from training.launch.forks import start_child
from training.protocol.entries import HOLD_FLAG
from training.protocol.events import Idle, JobOrder, read_event
from training.protocol.sealed import Sealed

__all__ = ["Child", "WarmPool"]

_CLOSE_GRACE_SECONDS = 5.0


def _read_lines(stream: Any, lines: queue.Queue[str | None]) -> None:
    try:
        for line in stream:
            lines.put(line)
    except (OSError, ValueError):
        pass
    lines.put(None)


def _is_idle(line: str) -> bool:
    return isinstance(read_event(line), Idle)  # another line may be a user model printing


class Child:
    """One child process and the thread that reads its stdout lines."""

    def __init__(self, command: list[str], env: dict[str, str], hold: bool) -> None:
        # Its own process group: when it ends, anything it leaves behind (a DataLoader worker
        # orphaned by a SIGKILL, torchrun's ranks) is killed with the group, not left running.
        # A single-process worker is forked from the zygote (see training.launch.forks).
        self.proc = start_child([*command, HOLD_FLAG] if hold else command, env, stdin_pipe=hold)
        self.hold = hold
        # Orphans inherit the pipe, so its end of file can come long after the process is gone:
        # lines are read in a thread, and `follow` stops once the process has exited.
        self._lines: queue.Queue[str | None] = queue.Queue()
        assert self.proc.stdout is not None
        self._reader = threading.Thread(target=_read_lines, args=(self.proc.stdout, self._lines), daemon=True)
        self._reader.start()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def hand(self, job: Sealed, error_path: Path) -> bool:
        """Give a warm child its next job (its seal, on the child's stdin); False if it is gone
        (then start a fresh one)."""
        assert self.hold and self.proc.stdin is not None
        order = JobOrder(job=job.arg(), error=str(error_path), spawn_time=time.time())
        try:
            self.proc.stdin.write(order.model_dump_json() + "\n")
            self.proc.stdin.flush()
        except (OSError, ValueError):  # a broken pipe, or its stdin already closed
            return False
        return True

    def follow(self, on_line: Callable[[str], None]) -> int | None:
        """Pass its lines on until it exits (its exit code) or, kept warm, goes idle (None)."""
        while True:
            try:
                line = self._lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is None:
                    continue
                self._reader.join(timeout=1.0)  # the last lines written before the exit
                if self._lines.empty():
                    break
                continue
            if line is None:
                break
            if self.hold and _is_idle(line):
                return None
            on_line(line)
        return self.proc.wait()

    def stop(self, grace_seconds: float, sig: signal.Signals = signal.SIGTERM) -> None:
        """`sig` (it writes its emergency checkpoint; SIGINT says the user asked, SIGTERM that the
        machine is going), then SIGKILL after `grace_seconds`."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self._wait_or_kill(grace_seconds)

    def close(self) -> None:
        """End a warm child: end of file on its stdin; killed if it does not go."""
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        self._wait_or_kill(_CLOSE_GRACE_SECONDS)
        self.kill_group()

    def _wait_or_kill(self, seconds: float) -> None:
        try:
            self.proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill_group(self) -> None:
        """Whatever the exited child left in its process group."""
        if self.proc.poll() is None:
            return  # still running (we are unwinding without having stopped it): not ours to kill
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # nothing left in the group


class WarmPool:
    """Idle warm children, at most `size`; thread-safe (a study's rungs are task runs in threads)."""

    def __init__(self, size: int = 1) -> None:
        self.size = size
        self._idle: list[Child] = []
        self._lock = threading.Lock()

    def take(self) -> Child | None:
        with self._lock:
            while self._idle:
                child = self._idle.pop()
                if child.alive():
                    return child
                child.kill_group()
        return None

    def give(self, child: Child) -> None:
        with self._lock:
            if len(self._idle) < self.size and child.alive():
                self._idle.append(child)
                return
        child.close()

    def close(self) -> None:
        """End every idle child (the study is over)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for child in idle:
            child.close()
