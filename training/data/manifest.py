"""A packed dataset's manifest: its columns, its splits' rows, and where each shard is.

Two layouts are read:

- format 2 (what packing writes): a dataset is a list of segments, each packed once from a run
  of row groups of one source file and stored under `datasets/segments/<key>/` (see
  `training.data.ingest.segments`); `datasets/<fingerprint>/manifest.json` lists them and their shards;
- format 1 (written by earlier versions): the shards of the whole source in the dataset folder
  itself. Such a dataset is still read, trained on and evaluated as it is.

Whoever can write the storage root writes manifests too, so every name in one is checked before
it is joined to a folder: a shard name is a plain `.tar` file name, a segment a hex key.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from training.data.load.shard_cache import is_remote_dataset, segment_is_remote
from training.data.shards import FIELDS, Checksum
from training.errors import DataError, StorageError
from training.storage.files import is_plain_name

__all__ = ["SPLITS", "Classes", "DatasetManifest", "SegmentRef", "ShardInfo", "fields_of", "is_ragged", "is_segment_key",
           "load_manifest", "require_manifest", "segments_dir", "shard_folder"]

SPLITS = ("train", "validation", "test")
Classes = list[int] | list[str]
_KEY = re.compile(r"^[0-9a-f]{16,64}$")


def is_segment_key(key: object) -> bool:
    return isinstance(key, str) and bool(_KEY.match(key))


@dataclass(frozen=True)
class ShardInfo:
    name: str
    split: str
    rows: int
    bytes: int
    sha256: str
    xxh3_128: str = ""  # the loader's check; "" in manifests written before it (checked with sha256)
    segment: str = ""  # format 2: the segment holding it ("" in format 1: the dataset folder does)

    @property
    def checksum(self) -> Checksum:
        return Checksum("xxh3_128", self.xxh3_128) if self.xxh3_128 else Checksum("sha256", self.sha256)

    @property
    def key(self) -> str:
        """Unique within a dataset: caches and derived arrays are named by it."""
        return f"{self.segment}-{self.name}" if self.segment else self.name


@dataclass(frozen=True)
class SegmentRef:
    """A dataset's record of one of its segments."""

    key: str
    source: str  # the source file it was packed from
    row_groups: list[int]
    file_row: int  # its first row in that file
    rows: dict[str, int]
    classes: list[Any] = field(default_factory=list)  # multiclass: the label value of each stored code
    class_rows: list[int] = field(default_factory=list)  # ... and the file row where each first appears
    dropped_null_labels: int = 0  # its rows left out for a null label

    @property
    def train_rows(self) -> int:
        return self.rows["train"]


def segments_dir(dataset_dir: Path) -> Path:
    """Where format-2 segments live: beside the dataset folders."""
    return dataset_dir.parent / "segments"


def shard_folder(dataset_dir: Path, shard: ShardInfo) -> Path:
    return segments_dir(dataset_dir) / shard.segment if shard.segment else dataset_dir


@dataclass
class DatasetManifest:
    fingerprint: str
    format_version: int
    label: str
    numeric: list[str]
    categorical: list[str]
    rows: dict[str, int]
    positives: dict[str, int]
    shards: list[ShardInfo] = field(default_factory=list)
    sources: list[dict[str, object]] = field(default_factory=list)
    # Since data.task and data.vector: a manifest written before them reads as binary, no vectors.
    task: str = "binary"
    classes: Classes = field(default_factory=list)  # multiclass: label value of each class index
    vector: list[str] = field(default_factory=list)
    vector_dims: list[int] = field(default_factory=list)
    # Since data.text and data.image: raw texts and encoded images, one ragged field per column.
    text: list[str] = field(default_factory=list)
    image: list[str] = field(default_factory=list)
    segments: list[SegmentRef] = field(default_factory=list)  # format 2
    source: str = ""  # format 2: data.source as packed (a folder, a file or an s3:// prefix)

    @property
    def train_rows(self) -> int:
        return self.rows["train"]

    def where(self, name: str) -> str:
        """A source file's path or URI, for messages."""
        if not self.source or self.source.rstrip("/").endswith("/" + name) or self.source == name:
            return self.source or name
        return f"{self.source.rstrip('/')}/{name}"

    @property
    def fields(self) -> tuple[str, ...]:
        """The fields each shard member holds."""
        return fields_of(self.vector, self.text, self.image)

    def segment(self, key: str) -> SegmentRef | None:
        return next((s for s in self.segments if s.key == key), None)

    def source_row(self, shard: ShardInfo, row: int) -> tuple[str, int]:
        """(source file, row in it) of a stored row number (the "row" field of image datasets):
        a row of its file in format 2, a row of the whole source (files in name order) in format 1."""
        ref = self.segment(shard.segment) if shard.segment else None
        if ref is not None:
            return self.where(ref.source), row
        for source in self.sources:
            rows = int(source.get("rows", -1))  # type: ignore[call-overload]
            if rows < 0:
                break
            if row < rows:
                return str(source["name"]), row
            row -= rows
        return "the source", row

    def label_map(self, shard: ShardInfo) -> np.ndarray | None:
        """Multiclass, format 2: a segment stores its own label codes; this maps them to the
        dataset's class indices (None: the stored labels are the dataset's already)."""
        if self.task != "multiclass" or not shard.segment:
            return None
        ref = self.segment(shard.segment)
        if ref is None:
            raise DataError(f"dataset {self.fingerprint}: shard {shard.name} names segment {shard.segment}, which the "
                            "manifest does not list (damaged or tampered with)")
        return self.segment_label_map(ref)

    def segment_label_map(self, ref: SegmentRef) -> np.ndarray:
        """A segment's label codes -> the dataset's class indices (see `label_map`)."""
        index = {value: i for i, value in enumerate(self.classes)}
        missing = [i for i, v in enumerate(ref.classes) if v not in index]
        if missing:
            i = missing[0]
            at = f" at row {ref.class_rows[i]}" if i < len(ref.class_rows) else ""
            raise DataError(f"{self.where(ref.source)}: label column '{self.label}' has value {ref.classes[i]!r}{at}, which is not a "
                            "class of the train split; add train rows with it or drop the row")
        return np.array([index[v] for v in ref.classes], dtype=np.int64)

    def restricted_to(self, keys: set[str]) -> DatasetManifest:
        """This dataset with only the segments `keys` (to score some of its rows)."""
        segments = [s for s in self.segments if s.key in keys]
        return replace(self, segments=segments, shards=[s for s in self.shards if s.segment in keys],
                       rows={split: sum(s.rows[split] for s in segments) for split in SPLITS})

    def shards_of(self, split: str | tuple[str, ...]) -> list[ShardInfo]:
        splits = (split,) if isinstance(split, str) else split
        return [s for s in self.shards if s.split in splits]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, where: str = "dataset manifest") -> DatasetManifest:
        """The manifest in `text`, or one DataError naming `where`. Every shard must be a plain
        `.tar` name of a listed segment (or of the dataset folder), so that joining it to a
        folder never leaves that folder (sizes and hashes cannot help: the same hand writes them)."""
        try:
            raw = json.loads(text)
            raw["shards"] = [ShardInfo(**s) for s in raw["shards"]]
            raw["segments"] = [SegmentRef(**s) for s in raw.get("segments", [])]
            manifest = cls(**raw)
        except (ValueError, TypeError, KeyError, AttributeError) as err:  # UnicodeDecodeError is a ValueError
            raise DataError(f"{where} is unreadable ({type(err).__name__}: {err})") from None
        keys = {s.key for s in manifest.segments}
        bad_count = next((s.key for s in manifest.segments if type(s.dropped_null_labels) is not int
                          or s.dropped_null_labels < 0), None)
        if bad_count is not None:
            raise DataError(f"{where}: segment {bad_count!r} has a dropped_null_labels that is not a row count: "
                            "damaged or tampered with")
        bad_segment = next((s.key for s in manifest.segments if not is_segment_key(s.key)), None)
        if bad_segment is not None:
            raise DataError(f"{where} lists a segment that is not one ({bad_segment!r}): damaged or tampered with")
        for shard in manifest.shards:
            if not (is_plain_name(shard.name) and shard.name.endswith(".tar") and shard.split in SPLITS
                    and isinstance(shard.rows, int) and isinstance(shard.bytes, int)
                    and (shard.segment == "" or shard.segment in keys)):
                raise DataError(f"{where} lists a shard that is not a file of the dataset ({shard.name!r}, split "
                                f"{shard.split!r}, segment {shard.segment!r}): damaged or tampered with")
        return manifest


def fields_of(vector: list[str], text: list[str] = [], image: list[str] = []) -> tuple[str, ...]:  # noqa: B006
    """The stored fields: the fixed ones, "vec" for vector columns, a ragged "text<j>" or
    "image<j>" per text or image column, and "row" (the source row, so that an image that
    fails to decode in preprocessing is named by its row) when there are images."""
    fields = (*FIELDS, *(["vec"] if vector else []), *(f"text{j}" for j in range(len(text))),
              *(f"image{j}" for j in range(len(image))))
    return (*fields, "row") if image else fields


def is_ragged(field_name: str) -> bool:
    return field_name.startswith(("text", "image"))


def load_manifest(dataset_dir: Path, sha256: str | None = None) -> DatasetManifest | None:
    """The manifest of a complete dataset, or None when the dataset is absent or incomplete.
    With `sha256`, the manifest's bytes must have it (the one its parent read: a training job's
    `manifest_sha256`), or a StorageError says it changed."""
    path = dataset_dir / "manifest.json"
    if not path.exists():
        return None
    try:
        text = path.read_bytes()
    except OSError as err:
        raise DataError(f"{path} is unreadable ({err.strerror or err}); delete {dataset_dir} to pack it again") from None
    if sha256 is not None and hashlib.sha256(text).hexdigest() != sha256:
        raise StorageError(f"the dataset's manifest {path} changed after the parent read it (its sha256 is not the "
                           "one the training job carries): another writer of this storage root replaced it. Run "
                           "the same command again, and keep the root writable only by the pipeline's own runs")
    manifest = DatasetManifest.from_json(text, str(path))
    remote = is_remote_dataset(dataset_dir)
    for shard in manifest.shards:
        folder = shard_folder(dataset_dir, shard)
        if remote or (shard.segment and segment_is_remote(folder)):
            continue  # shards come from S3 on demand, through the shard cache
        p = folder / shard.name
        if not p.exists() or p.stat().st_size != shard.bytes:
            raise DataError(
                f"dataset {dataset_dir}: shard {shard.name}{f' of segment {shard.segment}' if shard.segment else ''} "
                "is missing or has the wrong size; run the same command again: the pack stage packs it again"
            )
    return manifest


def require_manifest(dataset_dir: Path, sha256: str | None = None) -> DatasetManifest:
    """The manifest of a complete dataset, or the one error every stage gives for a missing one."""
    manifest = load_manifest(dataset_dir, sha256)
    if manifest is None:
        raise DataError(f"dataset {dataset_dir} is incomplete (no manifest.json); rerun the pack stage")
    return manifest
