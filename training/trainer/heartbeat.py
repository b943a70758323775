"""How far a run got before it died: the step reached and the train seconds at that point.

A checkpoint says where the next attempt resumes; the heartbeat says how much work the dead
attempt did past it, which is the "lost work" in the report. Two copies:

- a local file, overwritten in place every step (one pwrite, no fsync), exact on the same machine;
- on an s3:// root, a small object published every `storage.heartbeat_seconds`, so a resume on a
  fresh machine (the usual case after a spot reclaim) still counts what was lost, to within one
  publishing interval. One PUT per interval costs nothing next to the machine.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from training.errors import RetrainError, StorageError
from training.storage.root import RUN, StorageRoot

__all__ = ["Beat", "Heartbeat", "RemoteHeartbeat"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Beat:
    step: int
    train_seconds: float


class RemoteHeartbeat:
    """The run's heartbeat on S3, published from a background thread (the loop never waits)."""

    def __init__(self, root: StorageRoot, run_rel: str, run_key: str, interval_s: float) -> None:
        assert root.remote is not None
        self.root, self.rel, self.run_key, self.interval_s = root, f"{run_rel}/heartbeat.json", run_key, interval_s
        self._latest: tuple[int, float] | None = None  # (step, train seconds), set every step
        self._published: tuple[int, float] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> Beat | None:
        """The last beat a dead attempt published, or None (none yet, or unreadable: accounting
        only, so a damaged object is a warning, never a failed run)."""
        assert self.root.remote is not None
        try:
            raw = self.root.remote.get_bytes(self.rel)
            if raw is None:
                return None
            data = json.loads(raw)
            return Beat(int(data["step"]), float(data["train_seconds"]))
        except (RetrainError, ValueError, TypeError, KeyError) as err:
            log.warning("ignoring the run's heartbeat %s: %s", self.root.display(self.rel), err)
            return None

    def start(self, beat: Beat) -> None:
        """Publish `beat` now (the resumed step: work lost before it is already counted, so a
        later resume must not count it again), then every interval from a thread."""
        self._latest = (beat.step, beat.train_seconds)
        self._publish()
        self._thread = threading.Thread(target=self._run, name="heartbeat-upload", daemon=True)
        self._thread.start()

    def update(self, step: int, train_seconds: float) -> None:
        self._latest = (step, train_seconds)  # one tuple per step, no object built; the thread reads it

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._publish()
            except RetrainError as err:  # the next interval tries again; only accounting suffers
                log.warning("could not publish the run's heartbeat: %s", err)

    def _publish(self) -> None:
        beat = self._latest
        if beat is None or beat == self._published:
            return
        assert self.root.remote is not None
        body = json.dumps({"step": beat[0], "train_seconds": beat[1]}).encode()
        self.root.remote.put_bytes(self.rel, body, self.root.tags(RUN, self.run_key))
        self._published = beat


class Heartbeat:
    """The local heartbeat file, and the remote one behind it when the root is on S3.

    The local file is also the run's writer lock: held while training (the kernel frees it when
    the process dies), so the heartbeat read at start-up is always a dead attempt's."""

    _FMT = "<qd"

    def __init__(self, path: Path, remote: RemoteHeartbeat | None = None) -> None:
        import fcntl

        self.path, self.remote = path, remote
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            # A POSIX record lock, not flock: it conflicts only with other processes, so a second
            # train() in this process (after an error left the first's descriptor open) is fine.
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # EACCES or EAGAIN: another process holds it
            os.close(self._fd)
            raise StorageError(f"run folder {path.parent} is being trained by another live process right now; "
                               "two processes must not train one run: wait for it to finish") from None

    def read(self) -> Beat | None:
        """The furthest beat of a dead attempt: the local file's on the same machine, the S3
        object's on a fresh one."""
        size = struct.calcsize(self._FMT)
        data = os.pread(self._fd, size, 0)
        local = Beat(*struct.unpack(self._FMT, data)) if len(data) == size else None
        remote = self.remote.read() if self.remote is not None else None
        beats = [b for b in (local, remote) if b is not None]
        return max(beats, key=lambda b: b.step) if beats else None

    def start(self, step: int, train_seconds: float) -> None:
        """Record where this attempt starts, before its first step: a kill before step 1 is then
        counted once, and the work lost before this point is never counted twice."""
        self.write(step, train_seconds)
        if self.remote is not None:
            self.remote.start(Beat(step, train_seconds))

    def write(self, step: int, train_seconds: float) -> None:
        os.pwrite(self._fd, struct.pack(self._FMT, step, train_seconds), 0)
        if self.remote is not None:
            self.remote.update(step, train_seconds)

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()
        os.close(self._fd)
