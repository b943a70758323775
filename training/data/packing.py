"""Parquet -> validated, deterministically split, content-addressed WebDataset shards.

Layout of one dataset, under `<root>/datasets/<fingerprint>/`:

    train-000000.tar  train-000001.tar ...  validation-000000.tar ...  test-000000.tar
    manifest.json     written last; its presence marks the dataset complete

The fingerprint covers the source bytes, the data config and the pack format version, so the
same input always lands in the same folder and a rerun finds its own earlier work.
Shards are written into `<fingerprint>.partial-<pid>/` and the folder is renamed into place
after the manifest is written, so a reader never sees half a dataset.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from pydantic import BaseModel, ConfigDict
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from training.config import DataConfig
from training.data.arrow_buffers import float32_values, int64_values, null_mask, one_chunk, validity
from training.data.labels import LABELS, Classes, MulticlassLabels, train_classes
from training.data.ragged import OFFSETS, Ragged, Rows, concat_rows, take_rows
from training.data.shard_cache import is_remote_dataset
from training.data.sources import PACK_FORMAT_VERSION, dataset_fingerprint, source_files
from training.data.shards import FIELDS, Checksum, ShardReader, ShardTarWriter, WrittenShard, encode_npy, member_bytes
from training.errors import DataError, RetrainError, StorageError
from training.storage.files import is_plain_name, read_json, write_json_atomic

log = logging.getLogger(__name__)

__all__ = [
    "FeatureValidator",
    "forget_verification",
    "feature_arrays",
    "require_manifest",
    "PackPart",
    "PackPlan",
    "plan_pack",
    "start_pack",
    "pack_part",
    "assemble_shards",
    "split_writers",
    "SPLITS",
    "ShardInfo",
    "DatasetManifest",
    "pack_serially",
    "abandon_pack",
    "PackedPart",
    "load_manifest",
    "category_hash",
]

SPLITS = ("train", "validation", "test")
_READ_BATCH_ROWS = 65_536
MISSING_CATEGORY = 0  # hash reserved for null categories


@dataclass(frozen=True)
class ShardInfo:
    name: str
    split: str
    rows: int
    bytes: int
    sha256: str
    xxh3_128: str = ""  # the loader's check; "" in manifests written before it (checked with sha256)

    @property
    def checksum(self) -> Checksum:
        return Checksum("xxh3_128", self.xxh3_128) if self.xxh3_128 else Checksum("sha256", self.sha256)


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

    @property
    def fields(self) -> tuple[str, ...]:
        """The fields each shard member holds."""
        return fields_of(self.vector, self.text, self.image)

    def source_row(self, row: int) -> tuple[str, int]:
        """(source file name, row in it) of a global source row (files in name order)."""
        for source in self.sources:
            rows = int(source.get("rows", -1))  # type: ignore[call-overload]
            if rows < 0:
                break
            if row < rows:
                return str(source["name"]), row
            row -= rows
        return "the source", row

    def shards_of(self, split: str) -> list[ShardInfo]:
        return [s for s in self.shards if s.split == split]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, where: str = "dataset manifest") -> DatasetManifest:
        """The manifest in `text`, or one DataError naming `where`. Whoever can write the storage
        root writes manifests too: every shard name must be a plain `.tar` file name, so that
        joining it to the dataset folder never leaves that folder (sizes and hashes cannot
        help, the same hand writes them)."""
        try:
            raw = json.loads(text)
            raw["shards"] = [ShardInfo(**s) for s in raw["shards"]]
            manifest = cls(**raw)
        except (ValueError, TypeError, KeyError) as err:  # UnicodeDecodeError is a ValueError
            raise DataError(f"{where} is unreadable ({type(err).__name__}: {err})") from None
        for shard in manifest.shards:
            if not (is_plain_name(shard.name) and shard.name.endswith(".tar") and shard.split in SPLITS
                    and isinstance(shard.rows, int) and isinstance(shard.bytes, int)):
                raise DataError(f"{where} lists a shard that is not a file of the dataset ({shard.name!r}, split "
                                f"{shard.split!r}): damaged or tampered with")
        return manifest


def fields_of(vector: list[str], text: list[str] = [], image: list[str] = []) -> tuple[str, ...]:  # noqa: B006
    """The stored fields: the fixed ones, "vec" for vector columns, a ragged "text<j>" or
    "image<j>" per text or image column, and "row" (the global source row, so that an image
    that fails to decode in preprocessing is named by its row) when there are images."""
    fields = (*FIELDS, *(["vec"] if vector else []), *(f"text{j}" for j in range(len(text))),
              *(f"image{j}" for j in range(len(image))))
    return (*fields, "row") if image else fields


def is_ragged(field_name: str) -> bool:
    return field_name.startswith(("text", "image"))


def load_manifest(dataset_dir: Path) -> DatasetManifest | None:
    """The manifest of a complete dataset, or None when the dataset is absent or incomplete."""
    path = dataset_dir / "manifest.json"
    if not path.exists():
        return None
    try:
        text = path.read_bytes()
    except OSError as err:
        raise DataError(f"{path} is unreadable ({err.strerror or err}); delete {dataset_dir} to pack it again") from None
    manifest = DatasetManifest.from_json(text, str(path))
    if is_remote_dataset(dataset_dir):
        return manifest  # shards come from S3 on demand, through the shard cache
    for shard in manifest.shards:
        p = dataset_dir / shard.name
        if not p.exists() or p.stat().st_size != shard.bytes:
            raise DataError(
                f"dataset {dataset_dir}: shard {shard.name} is missing or has the wrong size; "
                "delete the dataset folder to repack it"
            )
    return manifest


def require_manifest(dataset_dir: Path) -> DatasetManifest:
    """The manifest of a complete dataset, or the one error every stage gives for a missing one."""
    manifest = load_manifest(dataset_dir)
    if manifest is None:
        raise DataError(f"dataset {dataset_dir} is incomplete (no manifest.json); rerun the pack stage")
    return manifest


def category_hash(values: pa.Array) -> np.ndarray:
    """Stable 63-bit hash per value (str() of it); nulls map to MISSING_CATEGORY.

    Hashing the dictionary of distinct values, not every row, keeps this cheap.
    """
    encoded = pc.dictionary_encode(values.cast(pa.string()) if values.type != pa.string() else values)
    if isinstance(encoded, pa.ChunkedArray):
        encoded = encoded.combine_chunks()
    dictionary = encoded.dictionary.to_pylist()
    table = np.array(
        [
            (int.from_bytes(hashlib.blake2b(v.encode(), digest_size=8).digest(), "little") >> 1) or 1
            for v in dictionary
        ],
        dtype=np.int64,
    )
    indices = one_chunk(pc.cast(encoded.indices, pa.int64()))
    out = np.full(len(values), MISSING_CATEGORY, dtype=np.int64)
    valid = validity(indices).astype(bool)
    if table.size:
        out[valid] = table[int64_values(indices)[valid]]
    return out



class FeatureValidator:
    """Checks each record batch against the configured schema, naming file, column and row."""

    def __init__(self, config: DataConfig) -> None:
        self.config = config

    def check_schema(self, path: Path, schema: pa.Schema, with_label: bool = True) -> None:
        c = self.config
        wanted = [*([c.label] if with_label else []), *c.numeric, *c.categorical, *c.vector, *c.text, *c.image]
        missing = [n for n in wanted if n not in schema.names]
        if missing:
            raise DataError(f"{path}: missing column(s) {missing}; present: {schema.names}")
        repeated = [n for n in wanted if schema.names.count(n) > 1]
        if repeated:
            raise DataError(f"{path}: column '{repeated[0]}' appears {schema.names.count(repeated[0])} times in the "
                            "file's schema; give each column a distinct name")
        if with_label and c.task == "multiclass":
            MulticlassLabels.check_type(path, c.label, schema.field(c.label).type)
        for name in c.vector:
            t = schema.field(name).type
            if not ((pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t))
                    and (pa.types.is_floating(t.value_type) or pa.types.is_integer(t.value_type))):
                raise DataError(f"{path}: vector column '{name}' has type {t}, expected a list of floats")
        for name in c.text:
            t = schema.field(name).type
            if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t)):
                raise DataError(f"{path}: text column '{name}' has type {t}, expected strings")
        for name in c.image:
            t = schema.field(name).type
            if not (pa.types.is_binary(t) or pa.types.is_large_binary(t)):
                raise DataError(f"{path}: image column '{name}' has type {t}, expected binary (encoded PNG or JPEG)")

    def image(self, path: Path, name: str, col: pa.Array, first_row: int) -> Ragged:
        """The encoded images as they are (decoded by preprocessing); a null one is an error."""
        if col.null_count:
            i = int(np.flatnonzero(null_mask(col))[0])
            raise DataError(f"{path}: image column '{name}' is null at row {first_row + i}")
        return Ragged.from_arrow(col)

    def vector(self, path: Path, name: str, col: pa.Array, first_row: int, dim: int) -> np.ndarray:
        """A (rows, dim) float32 matrix; a null, short, long or non-finite vector is an error."""
        if col.null_count:
            i = int(np.flatnonzero(null_mask(col))[0])
            raise DataError(f"{path}: vector column '{name}' is null at row {first_row + i}")
        lengths = float32_values(pc.list_value_length(col))
        wrong = lengths != dim
        if wrong.any():
            i = int(np.flatnonzero(wrong)[0])
            raise DataError(f"{path}: vector column '{name}' has length {int(lengths[i])} at row {first_row + i}; "
                            f"every row needs {dim} values (the first row's length)")
        values = float32_values(pc.list_flatten(col)).reshape(len(col), dim)
        bad = ~np.isfinite(values).all(axis=1)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise DataError(f"{path}: vector column '{name}' has a NaN or infinite value at row {first_row + i}")
        return values

    def numeric(self, path: Path, name: str, col: pa.Array, first_row: int) -> np.ndarray:
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            try:
                col = pc.cast(col, pa.float64())
            except pa.ArrowInvalid:
                bad = next(
                    (i, v) for i, v in enumerate(col.to_pylist()) if v is not None and not _is_float(v)
                )
                raise DataError(
                    f"{path}: column '{name}' has non-numeric value {bad[1]!r} at row {first_row + bad[0]}"
                ) from None
        elif not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type) or pa.types.is_boolean(col.type)
                  or pa.types.is_decimal(col.type)):
            raise DataError(f"{path}: column '{name}' has type {col.type}, expected a numeric type")
        values = float32_values(col)
        # Nulls become NaN and are imputed with the train mean by preprocessing; Inf is an error.
        inf = np.isinf(values)
        if inf.any():
            i = int(np.flatnonzero(inf)[0])
            raise DataError(f"{path}: column '{name}' has an infinite value at row {first_row + i}")
        return values

    def label(self, path: Path, col: pa.Array, first_row: int, classes: Classes) -> np.ndarray:
        return LABELS[self.config.task].encode(path, self.config.label, col, first_row, classes)


def _is_float(v: str) -> bool:
    try:
        float(v)
    except ValueError:
        return False
    return True


def _split_of_rows(start: int, count: int, config: DataConfig) -> np.ndarray:
    """0=train, 1=validation, 2=test for global rows [start, start+count).

    A seeded hash of the global row index, not a shuffle: deterministic, streaming, and a row
    keeps its split when rows are appended to the source.
    """
    x = np.arange(start, start + count, dtype=np.uint64) + np.uint64(config.split_seed * 0x9E3779B97F4A7C15 % 2**64)
    # splitmix64 finaliser
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    u = (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    out = np.zeros(count, dtype=np.int8)
    out[u < config.validation_fraction + config.test_fraction] = 1
    out[u < config.test_fraction] = 2
    return out


class _SplitWriter:
    """Buffers one split's rows into micro-batches and rolls shards at the target size."""

    def __init__(self, split: str, out_dir: Path, config: DataConfig) -> None:
        self.split = split
        self.out_dir = out_dir
        self.rows_per_member = config.rows_per_member
        self.target_bytes = int(config.shard_size_mb * 1_000_000)
        self.fields = fields_of(config.vector, config.text, config.image)
        self.count_positives = LABELS[config.task].counts_positives()
        self.buffers: dict[str, list[Rows]] = {k: [] for k in self.fields}
        self.buffered = 0
        self.shards: list[ShardInfo] = []
        self.member_index = 0
        self._writer: ShardTarWriter | None = None
        self._closing: list[tuple[str, int, Future[WrittenShard]]] = []
        self._executor: ThreadPoolExecutor | None = None
        self._rows_in_shard = 0
        self.rows = 0
        self.positives = 0

    def add(self, arrays: dict[str, Rows]) -> None:
        for k in self.fields:
            self.buffers[k].append(arrays[k])
        self.buffered += len(arrays["label"])
        while self.buffered >= self.rows_per_member:
            self._emit(self.rows_per_member)

    def _take(self, n: int) -> dict[str, Rows]:
        merged = {k: concat_rows(v) for k, v in self.buffers.items()}
        head = {k: v[:n] for k, v in merged.items()}
        rest = {k: v[n:] for k, v in merged.items()}
        self.buffers = {k: [v] if len(v) else [] for k, v in rest.items()}
        self.buffered -= n
        return head

    def _emit(self, n: int) -> None:
        block = self._take(n)
        key = f"b{self.member_index:08d}"
        payloads = []
        for k in self.fields:
            values = block[k]
            if isinstance(values, Ragged):
                payloads += [(f"{key}.{k}.npy", encode_npy(values.data)),
                             (f"{key}.{k}{OFFSETS}.npy", encode_npy(values.offsets))]
            else:
                payloads.append((f"{key}.{k}.npy", encode_npy(values)))
        size = sum(member_bytes(len(p)) for _, p in payloads)
        if self._writer is not None and self._writer.bytes_written + size + 1024 > self.target_bytes:
            self._close_shard()
        if self._writer is None:
            self._open_shard()
        assert self._writer is not None
        for name, payload in payloads:
            self._writer.add(name, payload)
        self.member_index += 1
        self._rows_in_shard += n
        self.rows += n
        if self.count_positives:
            self.positives += int(block["label"].sum())  # type: ignore[union-attr]

    def _open_shard(self) -> None:
        name = f"{self.split}-{len(self.shards) + len(self._closing):06d}.tar"
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"shard-writer-{self.split}")
        self._writer = ShardTarWriter(self.out_dir / name, self._executor)
        self._rows_in_shard = 0
        self._name = name

    def _close_shard(self) -> None:
        assert self._writer is not None
        # Written and fsynced in the background; `finish` collects the sizes and hashes.
        self._closing.append((self._name, self._rows_in_shard, self._writer.close()))
        self._writer = None

    def finish(self) -> None:
        if self.buffered:
            self._emit(self.buffered)
        if self._writer is not None:
            self._close_shard()
        for name, rows, done in self._closing:
            written = done.result()
            self.shards.append(ShardInfo(name, self.split, rows, written.bytes, written.sha256, written.xxh3_128))
        self._closing = []
        self._stop_thread()

    def _stop_thread(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def abort(self) -> None:
        """Stop writing (the pack failed): wait for the background writes, close the files."""
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
        for _, _, done in self._closing:
            done.exception()
        self._closing = []
        self._stop_thread()


def _iter_batches(path: Path, columns: list[str]) -> Iterator[pa.RecordBatch]:
    try:
        pf = pq.ParquetFile(path)
        yield from pf.iter_batches(batch_size=_READ_BATCH_ROWS, columns=columns)
    except (pa.ArrowInvalid, OSError) as err:
        raise DataError(f"{path}: not a readable Parquet file (truncated or corrupt?): {err}") from None


class PackPart(BaseModel):
    """A contiguous run of Parquet row groups: the unit of parallel packing.

    `row` is its first row in the whole source (files in name order), which fixes the split of
    every row it holds, so parts can be packed in any order, anywhere, and still assemble into
    the shards a serial pack writes."""

    model_config = ConfigDict(frozen=True)

    index: int
    file: str
    row_groups: list[int]
    file_row: int  # first row of the part within its file (for error messages)
    row: int  # first row of the part in the whole source
    rows: int


class PackPlan(BaseModel):
    """What a pack will write, decided from Parquet metadata alone: it crosses task boundaries
    (a flow maps `pack_part` over its parts) as it is."""

    model_config = ConfigDict(frozen=True)

    source: str
    fingerprint: str
    sources: list[dict[str, object]]
    work_dir: str
    final_dir: str
    parts: list[PackPart]
    classes: Classes = []  # multiclass: found in the train split before packing
    vector_dims: list[int] = []


class PackedPart(BaseModel):
    """What one part put in each split: rows, and positives of a binary label."""

    model_config = ConfigDict(frozen=True)

    rows: dict[str, int]
    positives: dict[str, int]


def _verified_record(dataset_dir: Path) -> Path:
    """Shard name -> [size, mtime_ns] when its sha256 last matched; beside the dataset, whose
    own bytes stay reproducible."""
    return dataset_dir.with_name(f".{dataset_dir.name}.verified.json")


def forget_verification(dataset_dir: Path) -> None:
    """Make the next pack stage check every shard of the dataset again (a reader found one
    damaged that its record said was verified)."""
    _verified_record(dataset_dir).unlink(missing_ok=True)


def _reusable(final_dir: Path) -> DatasetManifest | None:
    """A packed dataset's manifest when every shard still matches it. A damaged dataset is
    derived data and its Parquet source is at hand: it is removed (with a warning) and packed
    again, rather than failing every run until someone deletes it."""
    try:
        manifest = load_manifest(final_dir)
        if manifest is None or is_remote_dataset(final_dir):
            return manifest  # remote shards are verified as the shard cache downloads them
        damage = _first_damaged_shard(final_dir, manifest)
    except (DataError, ValueError, KeyError, TypeError) as err:  # a manifest that is not one
        damage = str(err)
    if damage is None:
        return manifest
    log.warning("%s; packing it again from the Parquet source", damage)
    trash = final_dir.with_name(f"{final_dir.name}.damaged-{uuid.uuid4().hex[:12]}")
    os.rename(final_dir, trash)  # out of the way at once; readers never see a half-deleted dataset
    shutil.rmtree(trash, ignore_errors=True)
    _verified_record(final_dir).unlink(missing_ok=True)
    return None


def _first_damaged_shard(dataset_dir: Path, manifest: DatasetManifest) -> str | None:
    """Hash the shards whose size or mtime changed since they last verified (all of them the
    first time): a reuse costs a stat per shard, and any write to a shard is seen."""
    record_path = _verified_record(dataset_dir)
    try:
        verified = read_json(record_path) or {}
    except RetrainError:
        verified = {}
    current = _stamps(dataset_dir, manifest)
    for shard in manifest.shards:
        if verified.get(shard.name) == current[shard.name]:
            continue
        checksum = shard.checksum
        if not checksum.matches_file(dataset_dir / shard.name):
            return f"dataset {dataset_dir}: shard {shard.name} does not match its {checksum.algorithm} in the manifest (corrupt)"
        reader = ShardReader(dataset_dir / shard.name)
        try:
            reader.check_members()  # a hash proves the bytes are the manifest's, not that packing wrote them
        except DataError as err:
            return str(err)
        finally:
            reader.close()
    if current != verified:
        try:
            write_json_atomic(record_path, current)
        except OSError:
            pass  # a read-only dataset: verified again next time
    return None


def _stamps(dataset_dir: Path, manifest: DatasetManifest) -> dict[str, list[int]]:
    stamps = {}
    for shard in manifest.shards:
        st = (dataset_dir / shard.name).stat()
        stamps[shard.name] = [st.st_size, st.st_mtime_ns]
    return stamps


def plan_pack(source: Path, config: DataConfig, datasets_root: Path, max_parts: int = 8) -> tuple[PackPlan | None, DatasetManifest | None]:
    """(plan, None) for a dataset still to pack, or (None, manifest) when it is already complete.

    Reads only Parquet metadata: the schema of every file is checked here, and row groups are
    grouped into at most `max_parts` parts of about equal rows.
    """
    files = source_files(source)
    fp, sources = dataset_fingerprint(files, config)
    final_dir = datasets_root / fp
    existing = _reusable(final_dir)
    if existing is not None:
        return None, existing
    validator = FeatureValidator(config)
    groups: list[tuple[str, int, int, int]] = []  # (file, row group, file row, rows)
    for path in files:
        try:
            meta = pq.ParquetFile(path)
            schema = meta.schema_arrow
        except (pa.ArrowInvalid, OSError) as err:
            raise DataError(f"{path}: not a readable Parquet file (truncated or corrupt?): {err}") from None
        validator.check_schema(path, schema)
        file_row = 0
        for rg in range(meta.metadata.num_row_groups):
            n = meta.metadata.row_group(rg).num_rows
            groups.append((str(path), rg, file_row, n))
            file_row += n
        if config.image:  # maps a stored global row back to its file (see DatasetManifest.source_row)
            sources[files.index(path)]["rows"] = file_row
    total = sum(g[3] for g in groups)
    if total == 0:
        raise DataError(f"{source}: the table is empty (0 rows)")
    classes: Classes = []
    if config.task == "multiclass":
        classes = train_classes(files, config.label, _iter_batches,
                                lambda start, n: _split_of_rows(start, n, config) == 0)
    dims = [_vector_dim(files, name) for name in config.vector]
    target = -(-total // max(1, max_parts))
    parts: list[PackPart] = []
    row = 0
    current: list[tuple[str, int, int, int]] = []

    def close() -> None:
        nonlocal row
        if current:
            n = sum(g[3] for g in current)
            parts.append(PackPart(index=len(parts), file=current[0][0], row_groups=[g[1] for g in current],
                                  file_row=current[0][2], row=row, rows=n))
            row += n
            current.clear()

    for group in groups:
        # A part never spans files, so each task opens one file.
        if current and (current[0][0] != group[0] or sum(g[3] for g in current) + group[3] > target):
            close()
        current.append(group)
    close()
    # Private to this pack: two packers of the same input never share a work folder.
    work_dir = datasets_root / f"{fp}.partial-{uuid.uuid4().hex[:12]}"
    return PackPlan(source=str(source), fingerprint=fp, sources=sources, work_dir=str(work_dir),
                    final_dir=str(final_dir), parts=parts, classes=classes, vector_dims=dims), None


def _vector_dim(files: list[Path], name: str) -> int:
    """A vector column's length: its fixed size, or the first non-null row's length."""
    t = pq.ParquetFile(files[0]).schema_arrow.field(name).type
    if pa.types.is_fixed_size_list(t):
        return int(t.list_size)
    for path in files:
        for batch in _iter_batches(path, [name]):
            lengths = pc.list_value_length(batch.column(0)).drop_null()
            if len(lengths):
                dim = int(lengths[0].as_py())
                if dim == 0:
                    raise DataError(f"{path}: vector column '{name}' holds empty lists")
                return dim
    raise DataError(f"{files[0]}: vector column '{name}' is null in every row")


def _piece(work_dir: Path, part: int, split: str, key: str) -> Path:
    return work_dir / "pieces" / f"{part:06d}.{split}.{key}.npy"


def _piece_memmap(path: Path, dtype: type, shape: tuple[int, ...]) -> np.memmap:
    """A memory-mapped .npy piece with every block allocated up front.

    A sparse memory-mapped file that meets a full disk faults on a page write: SIGBUS kills
    the process with no message and no clean-up. Allocated here, a full disk is an ENOSPC
    raised at this line instead, which becomes one StorageError naming the file."""
    try:
        arr = np.lib.format.open_memmap(path, "w+", dtype, shape)
        with open(path, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            try:
                os.posix_fallocate(f.fileno(), 0, size)
            except OSError as err:
                if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem without it
                    raise
    except OSError as err:
        raise StorageError(f"cannot write pack piece {path}: {err.strerror or err}; free space (or set "
                           "storage.root elsewhere) and run the same command again") from None
    return arr


def pack_part(plan: PackPlan, part: PackPart, config: DataConfig,
              writers: dict[str, _SplitWriter] | None = None) -> PackedPart:
    """Validate and transform one part's rows into per-split pieces (.npy) in the work folder,
    or, given the split `writers` of a serial pack (parts fed in order), straight into shards.

    Holds one record batch of the part in memory at a time. Idempotent: a retried part
    overwrites its own pieces."""
    work_dir = Path(plan.work_dir)
    (work_dir / "pieces").mkdir(parents=True, exist_ok=True)
    path = Path(part.file)
    validator = FeatureValidator(config)
    # Split sizes in bounded chunks: a part can hold millions of rows, and the hash's
    # temporaries are 8 bytes a row each (a whole 5M-row part at once cost 40 MB of peak RSS).
    counts = dict.fromkeys(SPLITS, 0)
    for lo in range(0, part.rows, _READ_BATCH_ROWS):
        found = np.bincount(_split_of_rows(part.row + lo, min(_READ_BATCH_ROWS, part.rows - lo), config),
                            minlength=len(SPLITS))
        for code, name in enumerate(SPLITS):
            counts[name] += int(found[code])
    shapes = _field_shapes(config, plan)
    # split -> field -> np.memmap, or a _RaggedPiece for a ragged field
    outs: dict[str, dict[str, Any]] = {} if writers is not None else {
        name: {k: _RaggedPiece(_piece(work_dir, part.index, name, k), counts[name]) if is_ragged(k)
               else _piece_memmap(_piece(work_dir, part.index, name, k), dtype, (counts[name], *tail))
               for k, (dtype, tail) in shapes.items()}
        for name in SPLITS
    }
    filled = dict.fromkeys(SPLITS, 0)
    positives = dict.fromkeys(SPLITS, 0)
    count_positives = LABELS[config.task].counts_positives()
    offset = 0
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=_READ_BATCH_ROWS, row_groups=list(part.row_groups),
                                                    columns=[config.label, *config.numeric, *config.categorical,
                                                             *config.vector, *config.text, *config.image])
        for batch in batches:
            arrays = _batch_arrays(validator, path, batch, part.file_row + offset, plan, part.row + offset)
            split = _split_of_rows(part.row + offset, batch.num_rows, config)
            # One stable gather groups the rows by split, keeping their order within each;
            # cheaper than a boolean selection per split and array (measured in the packer).
            order = np.argsort(split, kind="stable")
            bounds = np.concatenate(([0], np.cumsum(np.bincount(split, minlength=len(SPLITS)))))
            arrays = {k: take_rows(v, order) for k, v in arrays.items()}
            for code, name in enumerate(SPLITS):
                a, b = int(bounds[code]), int(bounds[code + 1])
                k = b - a
                if k:
                    lo = filled[name]
                    if writers is not None:
                        writers[name].add({key: v[a:b] for key, v in arrays.items()})
                    else:
                        for key, v in arrays.items():
                            outs[name][key][lo : lo + k] = v[a:b]
                    if count_positives:
                        positives[name] += int(np.sum(arrays["label"][a:b]))  # type: ignore[arg-type]
                    filled[name] += k
            offset += batch.num_rows
    except (pa.ArrowInvalid, OSError) as err:
        raise DataError(f"{path}: not a readable Parquet file (truncated or corrupt?): {err}") from None
    for pieces in outs.values():
        for piece in pieces.values():
            piece.flush()
    if offset != part.rows:
        raise DataError(f"{path}: row groups {list(part.row_groups)} hold {offset} rows, its metadata says {part.rows}")
    return PackedPart(rows=counts, positives=positives)


def _field_shapes(config: DataConfig, plan: PackPlan) -> dict[str, tuple[type, tuple[int, ...]]]:
    """dtype and per-row shape of each stored array."""
    shapes: dict[str, tuple[type, tuple[int, ...]]] = {
        "num": (np.float32, (len(config.numeric),)), "cat": (np.int64, (len(config.categorical),)),
        "label": (LABELS[config.task].dtype, ())}
    if config.vector:
        shapes["vec"] = (np.float32, (sum(plan.vector_dims),))
    for k in fields_of(config.vector, config.text, config.image):
        if is_ragged(k):
            shapes[k] = (np.uint8, ())  # a _RaggedPiece: bytes appended, one length per row
    if config.image:
        shapes["row"] = (np.int64, ())
    return shapes


class _RaggedPiece:
    """A ragged field's piece of a part: the rows' bytes appended to `<piece>.bin` as they
    arrive (their total is unknown before), the row lengths in a preallocated .npy. Rows
    arrive in order, so appending keeps them in order."""

    def __init__(self, path: Path, rows: int) -> None:
        self.lengths = _piece_memmap(path, np.int64, (rows,))
        self.path = path.with_suffix(".bin")
        self._file = open(self.path, "wb")

    def __setitem__(self, rows: slice, values: Ragged) -> None:
        self.lengths[rows] = np.diff(values.offsets)
        try:
            self._file.write(np.ascontiguousarray(values.data).tobytes())
        except OSError as err:
            raise StorageError(f"cannot write pack piece {self.path}: {err.strerror or err}; free space (or set "
                               "storage.root elsewhere) and run the same command again") from None

    def flush(self) -> None:
        self.lengths.flush()
        self._file.close()

    @staticmethod
    def load(path: Path) -> Ragged:
        lengths = np.load(path, mmap_mode="r")
        data_path = path.with_suffix(".bin")
        size = data_path.stat().st_size
        data = np.memmap(data_path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        return Ragged(data, np.concatenate(([0], np.cumsum(lengths))).astype(np.int64))


def _batch_arrays(validator: FeatureValidator, path: Path, batch: pa.RecordBatch, first: int,
                  plan: PackPlan, global_first: int) -> dict[str, Rows]:
    """One record batch validated and encoded: an array per stored field, rows in file order."""
    label = validator.label(path, batch.column(validator.config.label), first, plan.classes)
    return {"label": label, **feature_arrays(validator, path, batch, first, plan.vector_dims, global_first)}


def feature_arrays(validator: FeatureValidator, path: Path, batch: pa.RecordBatch, first: int, vector_dims: list[int],
                   global_first: int = 0) -> dict[str, Rows]:
    """The feature columns of a record batch validated and encoded as packing stores them (so
    scoring new data reads them exactly as training did): num, cat, vec, text<j>, image<j>."""
    config, n = validator.config, batch.num_rows
    num = np.empty((n, len(config.numeric)), dtype=np.float32)
    arrays: dict[str, Rows] = {"num": num}
    for j, name in enumerate(config.numeric):
        num[:, j] = validator.numeric(path, name, batch.column(name), first)
    cat = np.empty((n, len(config.categorical)), dtype=np.int64)
    arrays["cat"] = cat
    for j, name in enumerate(config.categorical):
        cat[:, j] = category_hash(batch.column(name))
    if config.vector:
        arrays["vec"] = np.concatenate(
            [validator.vector(path, name, batch.column(name), first, dim)
             for name, dim in zip(config.vector, vector_dims, strict=True)], axis=1)
    for j, name in enumerate(config.text):
        arrays[f"text{j}"] = Ragged.from_arrow(batch.column(name))  # a null text is empty
    for j, name in enumerate(config.image):
        arrays[f"image{j}"] = validator.image(path, name, batch.column(name), first)
    if config.image:
        arrays["row"] = np.arange(global_first, global_first + n, dtype=np.int64)
    return arrays


def split_writers(plan: PackPlan, config: DataConfig) -> dict[str, _SplitWriter]:
    return {s: _SplitWriter(s, Path(plan.work_dir), config) for s in SPLITS}


def assemble_shards(plan: PackPlan, parts: list[PackedPart], config: DataConfig,
                    writers: dict[str, _SplitWriter] | None = None) -> DatasetManifest:
    """Write every split's shards from the pieces, in part order (or finish `writers` that the
    parts fed directly), then the manifest (last), and rename the work folder into place. The
    bytes do not depend on how parts were packed."""
    fed = writers is not None
    writers = writers if writers is not None else split_writers(plan, config)
    try:
        _write_pieces(plan, writers, [] if fed else plan.parts)
        _check_splits(Path(plan.source), config, writers, plan.classes)
    except BaseException:
        abandon_pack(plan, writers)
        raise
    return _publish_pack(plan, config, writers)


def _publish_pack(plan: PackPlan, config: DataConfig, writers: dict[str, _SplitWriter]) -> DatasetManifest:
    """The manifest (last) into the finished work folder, and the folder renamed into place."""
    work_dir = Path(plan.work_dir)
    final_dir = Path(plan.final_dir)
    manifest = DatasetManifest(
        fingerprint=plan.fingerprint,
        format_version=PACK_FORMAT_VERSION,
        label=config.label,
        numeric=list(config.numeric),
        categorical=list(config.categorical),
        rows={s: writers[s].rows for s in SPLITS},
        positives={s: writers[s].positives for s in SPLITS},
        shards=[shard for s in SPLITS for shard in writers[s].shards],
        sources=plan.sources,
        task=config.task, classes=plan.classes, vector=list(config.vector), vector_dims=plan.vector_dims,
        text=list(config.text), image=list(config.image),
    )
    tmp = work_dir / "manifest.json.tmp"
    tmp.write_text(manifest.to_json())
    os.replace(tmp, work_dir / "manifest.json")
    try:
        os.rename(work_dir, final_dir)
        # The shards' hashes were taken as they were written: they verify now, by construction.
        write_json_atomic(_verified_record(final_dir), _stamps(final_dir, manifest))
    except OSError:
        # Another packer of the same input won the race; its dataset is identical.
        shutil.rmtree(work_dir, ignore_errors=True)
        if load_manifest(final_dir) is None:
            raise
    return manifest


def _write_pieces(plan: PackPlan, writers: dict[str, _SplitWriter], parts: list[PackPart]) -> None:
    work_dir = Path(plan.work_dir)
    for part in parts:
        for name in SPLITS:
            fields = writers[name].fields
            arrays: dict[str, Rows] = {
                k: _RaggedPiece.load(_piece(work_dir, part.index, name, k)) if is_ragged(k)
                else np.load(_piece(work_dir, part.index, name, k), mmap_mode="r") for k in fields}
            for lo in range(0, len(arrays["label"]), _READ_BATCH_ROWS):
                writers[name].add({k: _copied(v[lo : lo + _READ_BATCH_ROWS]) for k, v in arrays.items()})
            for k in fields:
                _piece(work_dir, part.index, name, k).unlink()  # keep the disk bounded as we go
                _piece(work_dir, part.index, name, k).with_suffix(".bin").unlink(missing_ok=True)
    shutil.rmtree(work_dir / "pieces", ignore_errors=True)
    for w in writers.values():
        w.finish()


def _copied(values: Rows) -> Rows:
    """Out of the memory-mapped piece, which is deleted next."""
    if isinstance(values, Ragged):
        return Ragged(np.array(values.data), values.offsets.copy())
    return np.array(values)


def start_pack(plan: PackPlan) -> None:
    """A fresh work folder (what a dead packer left there is not trusted)."""
    work_dir = Path(plan.work_dir)
    shutil.rmtree(work_dir, ignore_errors=True)
    work_dir.mkdir(parents=True)


def pack_serially(plan: PackPlan, config: DataConfig) -> DatasetManifest:
    """Pack every part of `plan` in this process, in order, straight into the shard writers (no
    pieces on disk), then assemble; the bytes are those of a pack fanned out over the parts. A
    failure leaves nothing behind (`abandon_pack`)."""
    start_pack(plan)
    writers = split_writers(plan, config)
    try:
        results = [pack_part(plan, part, config, writers) for part in plan.parts]
    except BaseException:
        abandon_pack(plan, writers)
        raise
    return assemble_shards(plan, results, config, writers)  # it cleans up after itself too


def abandon_pack(plan: PackPlan, writers: dict[str, _SplitWriter] | None = None) -> None:
    """The one clean-up of a failed pack: stop the shard writers (their files are still being
    written), then remove the work folder, so nothing of the attempt is left behind."""
    for writer in (writers or {}).values():
        writer.abort()
    shutil.rmtree(plan.work_dir, ignore_errors=True)


def _check_splits(source: Path, config: DataConfig, writers: dict[str, _SplitWriter], classes: Classes) -> None:
    rows = {name: w.rows for name, w in writers.items()}
    LABELS[config.task].check_splits(source, config.label, rows, {name: w.positives for name, w in writers.items()},
                                     classes)
    for name, n in rows.items():
        if n == 0:
            raise DataError(
                f"{source}: the {name} split is empty ({sum(rows.values())} rows in all); add rows or raise "
                f"data.{name}_fraction"
            )
