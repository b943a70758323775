"""Where a dataset's rows come from: a Parquet or CSV file, a folder of them, or an s3:// prefix.

A source lists its files with an identity that changes whenever a file's bytes may have
changed, without reading them: for a local file its size, modification and change times and
inode (any write moves the change time, which no tool can set back); for an S3 object its
size and ETag. Packing remembers what it found in each file under that identity
(`training.data.ingest.source_index`), so a file seen before is never read again.

Reads are ranged (a Parquet footer, a run of row groups) and counted, so a run can report how
many bytes it read from the source. A CSV file is read whole once per process and served as its
Parquet conversion (`as_parquet`, `training.data.ingest.csv_files`). Kept free of pyarrow and torch: `retrain run` consults the
source before it loads the pipeline (`training.pipeline.unchanged`).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Protocol

from pydantic import BaseModel, ConfigDict

from training.config import StorageConfig
from training.data.ingest.csv_files import CONVERSIONS, CSV_SUFFIXES, is_csv
from training.errors import DataError
from training.copies import updated

__all__ = ["LocalSource", "S3Source", "Source", "SourceFile", "open_source", "source_files"]


class SourceFile(BaseModel):
    """One Parquet or CSV file of a source: its name (relative to the source; the file's own name for
    a one-file source), size and identity stamp."""

    model_config = ConfigDict(frozen=True)

    name: str
    size: int
    stamp: str


class Source(Protocol):
    uri: str

    @property
    def bytes_read(self) -> int: ...

    def files(self) -> list[SourceFile]: ...

    def read(self, name: str, offset: int, length: int) -> bytes: ...

    def where(self, name: str) -> str: ...

    def as_parquet(self, file: SourceFile) -> SourceFile: ...


class _Counter:
    """Bytes read through a source, from any thread (packing reads on several)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.total += n


SOURCE_SUFFIXES = (".parquet", *CSV_SUFFIXES)


def is_source_file(name: str) -> bool:
    """A Parquet or CSV file that is not hidden (a writer's temporary file starts with a dot)."""
    return name.lower().endswith(SOURCE_SUFFIXES) and not name.rsplit("/", 1)[-1].startswith(".")


def source_files(source: Path, setting: str = "data.source") -> list[Path]:
    """The Parquet and CSV files of a local source, in name order (a folder: every one below it)."""
    if source.is_dir():
        files = sorted(p for p in source.rglob("*") if p.is_file() and is_source_file(p.name))
        if not files:
            raise DataError(f"{setting} {source} is a folder with no .parquet or .csv files in it")
        _refuse_links_out(source, files, setting)
        return files
    if not source.exists():
        raise DataError(f"{setting} {source} does not exist")
    return [source]


def _refuse_links_out(source: Path, files: list[Path], setting: str) -> None:
    """A folder's files must be in the folder: a symbolic link in it that leads elsewhere (to
    `/etc/passwd` named `x.csv`, to another team's table) is refused, naming the link and never
    quoting what it points at, since an error would show its first line."""
    base = source.resolve()
    for path in files:
        resolved = path.resolve()
        if base not in resolved.parents:
            raise DataError(f"{setting} {source}: {path.relative_to(source)} is a symbolic link to a file outside the "
                            "folder; a source folder's files must lie inside it: copy the file in, or remove the link")


class LocalSource:
    """A local Parquet or CSV file or a folder of them."""

    def __init__(self, path: Path, setting: str = "data.source") -> None:
        self.path = path
        self.uri = str(path)
        self.setting = setting
        self._counter = _Counter()

    @property
    def bytes_read(self) -> int:
        return self._counter.total

    def _path(self, name: str) -> Path:
        return self.path / name if self.path.is_dir() else self.path

    def files(self) -> list[SourceFile]:
        out = []
        for path in source_files(self.path, self.setting):
            st = path.stat()
            name = str(path.relative_to(self.path)) if self.path.is_dir() else path.name
            out.append(SourceFile(name=name, size=st.st_size,
                                  stamp=f"{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}:{st.st_dev}"))
        return out

    def as_parquet(self, file: SourceFile) -> SourceFile:
        """The file as Parquet: itself, or a CSV file's conversion (its reads come from there)."""
        if not is_csv(file.name):
            return file
        path = CONVERSIONS.converted(self.uri, file.name, file.stamp, self.where(file.name),
                                    lambda: self._read_whole(file.name))
        return SourceFile(name=file.name, size=path.stat().st_size, stamp=file.stamp)

    def _read_whole(self, name: str) -> bytes:
        path = self._path(name)
        try:
            data = path.read_bytes()
        except OSError as err:
            raise DataError(f"{path}: cannot read ({err.strerror or err})") from None
        self._counter.add(len(data))
        return data

    def read(self, name: str, offset: int, length: int) -> bytes:
        path = CONVERSIONS.path(self.uri, name) if is_csv(name) else self._path(name)
        try:
            with open(path, "rb") as f:
                data = os.pread(f.fileno(), length, offset)
        except OSError as err:
            raise DataError(f"{path}: cannot read ({err.strerror or err})") from None
        if not is_csv(name):  # a CSV file's bytes were counted when it was read whole
            self._counter.add(len(data))
        if len(data) != length:
            raise DataError(f"{path}: ended at byte {offset + len(data)}, before byte {offset + length} "
                            "(changed or truncated while being read?)")
        return data

    def where(self, name: str) -> str:
        return str(self._path(name))


class S3Source:
    """The Parquet and CSV objects under an s3:// prefix, read with the storage root's endpoint, region
    and credentials (a source in another account needs a role or profile that reaches both)."""

    def __init__(self, uri: str, storage: StorageConfig) -> None:
        from training.storage.root import settings_for
        from training.storage.s3 import S3Store

        self.uri = uri
        prefix = uri.rstrip("/")
        self.only: str | None = None  # an s3:// URI naming one object
        if is_source_file(prefix) and prefix.count("/") > 2:
            prefix, self.only = prefix.rsplit("/", 1)
        self.store = S3Store(settings_for(updated(storage, {"root": prefix})))
        self._counter = _Counter()

    @property
    def bytes_read(self) -> int:
        return self._counter.total

    def files(self) -> list[SourceFile]:
        found = self.store.list_objects(self.only or "")
        files = [SourceFile(name=rel, size=size, stamp=etag) for rel, (size, etag) in sorted(found.items())
                 if is_source_file(rel) and (self.only is None or rel == self.only)]
        if not files:
            raise DataError(f"data.source {self.uri} holds no .parquet or .csv objects" if self.only is None
                            else f"data.source {self.uri} does not exist")
        return files

    def as_parquet(self, file: SourceFile) -> SourceFile:
        """The object as Parquet: itself, or a CSV object's conversion (its reads come from there)."""
        if not is_csv(file.name):
            return file

        def whole() -> bytes:
            data = self.store.get_range(file.name, 0, file.size) if file.size else b""
            self._counter.add(len(data))
            return data

        path = CONVERSIONS.converted(self.uri, file.name, file.stamp, self.where(file.name), whole)
        return SourceFile(name=file.name, size=path.stat().st_size, stamp=file.stamp)

    def read(self, name: str, offset: int, length: int) -> bytes:
        if is_csv(name):
            with open(CONVERSIONS.path(self.uri, name), "rb") as f:
                return os.pread(f.fileno(), length, offset)
        data = self.store.get_range(name, offset, length)
        self._counter.add(len(data))
        return data

    def where(self, name: str) -> str:
        return self.store.uri(name)


def open_source(spec: str | Path, storage: StorageConfig | None = None) -> LocalSource | S3Source:
    """The source `data.source` names: an s3:// prefix, or a local file or folder."""
    text = str(spec)
    if text.startswith("s3://"):
        return S3Source(text, storage or StorageConfig())
    return LocalSource(Path(text).expanduser())
