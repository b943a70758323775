"""One writer per local storage root on one machine: an advisory `fcntl` lock on `<root>/.writer.lock`.

The kernel drops the lock when its holder dies, however it dies (SIGKILL, OOM), so a crashed
run never blocks the next one. Prefect's global concurrency limit (tasks/runtime.py) does the
same across machines that share a Prefect server; this lock covers what that cannot: CLI runs
on their own temporary servers, whose leases of a dead holder are never reclaimed.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from training.errors import StorageError

__all__ = ["hold_root", "LOCK_NAME"]

LOCK_NAME = ".writer.lock"


def _holder(handle: int) -> str:
    try:
        raw = os.pread(handle, 4096, 0).decode(errors="replace")
        info = json.loads(raw) if raw.strip() else {}
    except (OSError, ValueError):
        return "another process"
    return f"pid {info.get('pid', '?')} on {info.get('host', '?')} since {info.get('since', '?')}"


@contextmanager
def hold_root(root: Path, on_wait: Callable[[str], None] = lambda message: None) -> Iterator[None]:
    """Hold the root's writer lock for the body; wait (after telling `on_wait` who holds it)
    while another process holds it."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_NAME
    try:
        handle = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise StorageError(f"cannot open the storage root's lock {path}: {err.strerror}; check that the root "
                           f"is writable") from None
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait(f"storage root {root} is in use by {_holder(handle)}; waiting for it to finish")
            fcntl.flock(handle, fcntl.LOCK_EX)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(handle, 0)
        os.pwrite(handle, json.dumps(info).encode(), 0)
        yield
    finally:
        os.close(handle)  # closing drops the lock
