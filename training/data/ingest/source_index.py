"""What packing found in each source file, remembered by the file's identity.

`datasets/source-index.json` maps (data config, source, file name, identity stamp) to the
segments packed from that file: their keys, row groups, rows and time range. A run over 30
files seen before and one new one reads the new one only: the others' segments are known
without opening them. Any change to a file changes its stamp (`training.data.ingest.sources`), so a
remembered entry never stands for other bytes; a missing or damaged index only costs reading
the files again (their segments are found already packed).

Whoever can write the storage root can write this file, as every manifest: the keys in it are
checked to be segment keys before they name a folder.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from training.config import DataConfig, fingerprint, fingerprinted
from training.data.ingest.sources import SourceFile
from training.data.manifest import is_segment_key
from training.storage.files import write_atomic

__all__ = ["INDEX_FILE", "WHOLE_FILE", "IndexedFile", "IndexedSegment", "SourceIndex", "dataset_fingerprint",
           "known_fingerprints", "legacy_fingerprint", "segment_config_key", "window"]

log = logging.getLogger(__name__)

INDEX_FILE = "source-index.json"
WHOLE_FILE = "sha256"  # the entries that record a whole file's sha256 (format-1 look-ups)


class IndexedSegment(BaseModel):
    model_config = ConfigDict(frozen=True)

    key: str
    row_groups: list[int]
    file_row: int
    rows: int
    time_range: list[float] | None = None


class IndexedFile(BaseModel):
    model_config = ConfigDict(frozen=True)

    size: int
    stamp: str
    segments: list[IndexedSegment]
    sha256: str = ""  # the whole file's, when a format-1 dataset had to be looked up by it


class _Stored(BaseModel):
    entries: dict[str, IndexedFile] = {}


def segment_config_key(config: DataConfig) -> str:
    """The part of the data config a segment's content depends on (not the window)."""
    view = fingerprinted(config)
    view.pop("window", None)
    return fingerprint("segment-config", view)


class SourceIndex:
    """The index of one storage root (see the module docstring)."""

    def __init__(self, path: Path, data: bytes | None = None) -> None:
        """The index stored at `path`, or held in `data` (as fetched from S3) when given."""
        self.path = path
        self.changed = False
        self._entries: dict[str, IndexedFile] = {}
        if data is not None or path.exists():
            try:
                self._entries = _Stored.model_validate_json(path.read_bytes() if data is None else data).entries
            except (OSError, ValidationError, ValueError) as err:
                log.warning("%s is unreadable (%s): the source's files are read again", path, str(err).splitlines()[0])
        self._entries = {k: v for k, v in self._entries.items() if all(is_segment_key(s.key) for s in v.segments)}

    @staticmethod
    def _key(config_key: str, source: str, name: str) -> str:
        return f"{config_key}|{source}|{name}"

    def lookup(self, config_key: str, source: str, file: SourceFile) -> IndexedFile | None:
        entry = self._entries.get(self._key(config_key, source, file.name))
        return entry if entry is not None and entry.size == file.size and entry.stamp == file.stamp else None

    def record(self, config_key: str, source: str, file: SourceFile, segments: list[IndexedSegment],
               sha256: str = "") -> None:
        key = self._key(config_key, source, file.name)
        entry = IndexedFile(size=file.size, stamp=file.stamp, segments=segments, sha256=sha256)
        if self._entries.get(key) != entry:
            self._entries[key] = entry
            self.changed = True

    def forget_missing(self, config_key: str, source: str, present: list[SourceFile]) -> None:
        """Drop the entries of files no longer in the source, so the index stays its size."""
        keep = {self._key(config_key, source, f.name) for f in present}
        prefix = f"{config_key}|{source}|"
        gone = [k for k in self._entries if k.startswith(prefix) and k not in keep]
        for k in gone:
            del self._entries[k]
        self.changed = self.changed or bool(gone)

    def to_bytes(self) -> bytes:
        return _Stored(entries=self._entries).model_dump_json().encode()

    def save(self) -> bool:
        """Write the index if it changed; False on a read-only root (it is derived data)."""
        if not self.changed:
            return False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, self.to_bytes())
        except OSError as err:
            log.warning("cannot write %s (%s): the new files are read again next time", self.path, err.strerror or err)
            return False
        self.changed = False
        return True


class _Windowed(Protocol):
    @property
    def time_range(self) -> list[float] | None: ...


W = TypeVar("W", bound=_Windowed)


def window(segments: list[W], config: DataConfig) -> list[W]:
    """The segments `data.window` keeps, given in source order (file name, then row), oldest
    first: by their newest row when there is a `data.time_column`, else in source order."""
    if config.time_column is not None:
        segments = sorted(segments, key=lambda s: s.time_range[1] if s.time_range else float("-inf"))
    last_days, last_segments = config.window.last_days, config.window.last_segments
    if last_days is not None:
        newest = max((s.time_range[1] for s in segments if s.time_range), default=None)
        if newest is not None:
            cutoff = newest - last_days * 86_400
            segments = [s for s in segments if s.time_range and s.time_range[1] >= cutoff]
    if last_segments is not None:
        segments = segments[-last_segments:]
    return segments


def dataset_fingerprint(segment_keys: list[str], config: DataConfig) -> str:
    """A segment dataset's content address: its segments and the data config."""
    return fingerprint("dataset", 2, fingerprinted(config), segment_keys)


def legacy_fingerprint(sizes: list[int], hashes: list[str], config: DataConfig) -> str:
    """The content address earlier versions gave a whole-source dataset (format 1)."""
    return fingerprint("dataset", 1, [(size, sha) for size, sha in zip(sizes, hashes, strict=True)],
                       fingerprinted(config))


def known_fingerprints(index: SourceIndex, config: DataConfig, source: str, files: list[SourceFile]) -> set[str]:
    """The fingerprints the pack stage would give these files, as far as the index knows them
    without reading a byte: the segment dataset's, and the format-1 dataset's."""
    found = set()
    ckey = segment_config_key(config)
    entries = [index.lookup(ckey, source, f) for f in files]
    if all(e is not None for e in entries):
        segments = [s for e in entries if e is not None for s in e.segments]
        found.add(dataset_fingerprint([s.key for s in window(segments, config)], config))
    whole = [index.lookup(WHOLE_FILE, source, f) for f in files]
    if all(e is not None and e.sha256 for e in whole):
        found.add(legacy_fingerprint([f.size for f in files], [e.sha256 for e in whole if e is not None], config))
    return found
