"""The study's state: Optuna's append-only journal, kept under the storage root.

Locally it is `tune/<study>/journal.log`, appended by Optuna's own `JournalFileBackend` (an
exclusive lock file, one write and an fsync per append). On an s3:// root the file is also
published after every append (one small PUT: trials, rung values, pruning decisions and spend are
each a few lines), and fetched at start, so a study killed on one spot machine resumes on a fresh
one. Only one writer runs per storage root (the flow holds the root), so publishing the whole
file is safe.

The file is input from whoever can write the root, and from a kill mid-append:
- every line passes `JournalGate` before Optuna replays it;
- a last line cut off by a kill is cut from the file on open, under the lock, so the next append
  starts a line of its own (Optuna's reader skips such a line, but its next append would glue a
  record onto it and damage the file for good);
- a damaged line anywhere else is one `DataError` naming it;
- a study that recorded spend (its calibration or report exists) refuses to start again from an
  empty or missing journal: its trials and spend would be forgotten, and its budget with them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Generator
from pathlib import Path
from typing import Any

from optuna.storages.journal import BaseJournalBackend, JournalFileBackend, JournalFileOpenLock

from training.errors import DataError
from training.storage.files import write_atomic
from training.storage.root import RUN, StorageRoot
from training.tune.journal_gate import JournalGate

__all__ = ["PublishedJournal", "SPEND_RECORDS"]

log = logging.getLogger(__name__)
SPEND_RECORDS = ("calibration.json", "tune_report.json")  # a study that wrote one has spent


class PublishedJournal(BaseJournalBackend):
    def __init__(self, root: StorageRoot, rel: str, gate: JournalGate) -> None:
        self.root, self.rel, self.gate = root, rel, gate
        self.path = path = root.path(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._adopt_remote(path)
        self._refuse_lost_spend(path)
        # An fcntl-free lock: the file may sit on a network file system.
        self._lock = JournalFileOpenLock(str(path) + ".lock")
        self.inner = JournalFileBackend(str(path), lock_obj=self._lock)
        self._repair()
        self._offsets = [0]  # byte offset of each log number read so far

    def _adopt_remote(self, path: Path) -> None:
        """Take S3's copy when it holds more than the local one (a fresh machine, or a local
        copy left behind by an older attempt). The journal only grows, so longer is newer."""
        if self.root.remote is None:
            return
        data = self.root.remote.get_bytes(self.rel)
        if data is not None and (not path.exists() or len(data) > path.stat().st_size):
            write_atomic(path, data)

    def _refuse_lost_spend(self, path: Path) -> None:
        if path.exists() and path.stat().st_size > 0:
            return
        folder = self.rel.rsplit("/", 1)[0]
        for name in SPEND_RECORDS:
            rel = f"{folder}/{name}"
            if self.root.path(rel).exists() or (self.root.remote is not None and self.root.remote.head(rel)):
                raise DataError(
                    f"{self.root.display(self.rel)} is {'empty' if path.exists() else 'missing'}, but the study "
                    f"recorded spend ({self.root.display(rel)}): starting again would forget its trials and "
                    "spend, and so its budget. Restore the journal (on an s3:// root, an earlier version of "
                    f"the published copy), or delete {self.root.display(folder)} to start a new study")

    def _repair(self) -> None:
        """Cut a last line that a kill left without its newline."""
        self._lock.acquire()  # as Optuna's appends hold it: no append is half-way while this cuts
        try:
            with open(self.path, "rb+") as f:
                size = f.seek(0, 2)
                if size == 0 or (f.seek(size - 1) >= 0 and f.read(1) == b"\n"):
                    return
                keep = _last_newline_end(f, size)
                f.truncate(keep)
                f.flush()
                os.fsync(f.fileno())
        finally:
            self._lock.release()
        log.warning("%s: cut %d bytes of a last line a kill left unfinished; the study goes on from the lines "
                    "before it", self.root.display(self.rel), size - keep)

    def read_logs(self, log_number_from: int) -> Generator[dict[str, Any], None, None]:
        """Each whole line from `log_number_from` on, as the gate admits it. A line still being
        appended (no newline yet) is left for the next read, as Optuna's reader does."""
        with open(self.path, "rb") as f:
            number = min(log_number_from, len(self._offsets) - 1)
            f.seek(self._offsets[number])
            for line in f:
                if not line.endswith(b"\n"):
                    return
                if number + 1 == len(self._offsets):
                    self._offsets.append(self._offsets[number] + len(line))
                if number >= log_number_from:
                    yield self.gate.admit(number, line)
                number += 1

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        self.inner.append_logs(logs)
        self.root.publish(self.rel, RUN)


def _last_newline_end(f: Any, size: int) -> int:
    """The offset just after the file's last newline (0 without one), reading back from `size`."""
    end = size
    while end > 0:
        start = max(0, end - (1 << 16))
        f.seek(start)
        chunk = f.read(end - start)
        at = chunk.rfind(b"\n")
        if at >= 0:
            return start + at + 1
        end = start
    return 0
