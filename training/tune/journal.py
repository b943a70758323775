"""The study's state: Optuna's append-only journal, kept under the storage root.

Locally it is Optuna's own `JournalFileBackend` in `tune/<study>/journal.log`. On an s3:// root
the file is also published after every append (one small PUT: trials, rung values, pruning
decisions and spend are each a few lines), and fetched at start, so a study killed on one spot
machine resumes on a fresh one. Only one writer runs per storage root (the flow holds the root),
so publishing the whole file is safe.
"""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path
from typing import Any

from optuna.storages.journal import BaseJournalBackend, JournalFileBackend, JournalFileOpenLock

from training.storage.files import write_atomic
from training.storage.root import RUN, StorageRoot

__all__ = ["PublishedJournal"]


class PublishedJournal(BaseJournalBackend):
    def __init__(self, root: StorageRoot, rel: str) -> None:
        self.root, self.rel = root, rel
        path = root.path(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._adopt_remote(path)
        # An fcntl-free lock: the file may sit on a network file system.
        self.inner = JournalFileBackend(str(path), lock_obj=JournalFileOpenLock(str(path) + ".lock"))

    def _adopt_remote(self, path: Path) -> None:
        """Take S3's copy when it holds more than the local one (a fresh machine, or a local
        copy left behind by an older attempt). The journal only grows, so longer is newer."""
        if self.root.remote is None:
            return
        data = self.root.remote.get_bytes(self.rel)
        if data is not None and (not path.exists() or len(data) > path.stat().st_size):
            write_atomic(path, data)

    def read_logs(self, log_number_from: int) -> Generator[dict[str, Any], None, None]:
        yield from self.inner.read_logs(log_number_from)

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        self.inner.append_logs(logs)
        self.root.publish(self.rel, RUN)
