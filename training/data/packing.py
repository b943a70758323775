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

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from training.config import DataConfig, fingerprint
from training.data.shards import ShardTarWriter, encode_npy, member_bytes
from training.errors import DataError
from training.storage import HashingWriter

__all__ = [
    "PACK_FORMAT_VERSION",
    "SPLITS",
    "ShardInfo",
    "DatasetManifest",
    "pack_shards",
    "load_manifest",
    "source_files",
    "category_hash",
]

PACK_FORMAT_VERSION = 1
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

    def shards_of(self, split: str) -> list[ShardInfo]:
        return [s for s in self.shards if s.split == split]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DatasetManifest:
        raw = json.loads(text)
        raw["shards"] = [ShardInfo(**s) for s in raw["shards"]]
        return cls(**raw)


def source_files(source: Path) -> list[Path]:
    if source.is_dir():
        files = sorted(p for p in source.rglob("*.parquet") if p.is_file())
        if not files:
            raise DataError(f"source directory {source} holds no *.parquet files")
        return files
    if not source.exists():
        raise DataError(f"source {source} does not exist; set data.source to a Parquet file or directory")
    return [source]


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def load_manifest(dataset_dir: Path) -> DatasetManifest | None:
    """The manifest of a complete dataset, or None when the dataset is absent or incomplete."""
    path = dataset_dir / "manifest.json"
    if not path.exists():
        return None
    manifest = DatasetManifest.from_json(path.read_text())
    for shard in manifest.shards:
        p = dataset_dir / shard.name
        if not p.exists() or p.stat().st_size != shard.bytes:
            raise DataError(
                f"dataset {dataset_dir}: shard {shard.name} is missing or has the wrong size; "
                "delete the dataset folder to repack it"
            )
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
    indices = encoded.indices.to_numpy(zero_copy_only=False)
    out = np.full(len(values), MISSING_CATEGORY, dtype=np.int64)
    valid = ~np.asarray(encoded.indices.is_null().to_numpy(zero_copy_only=False))
    if table.size:
        out[valid] = table[indices[valid].astype(np.int64)]
    return out


class _Validator:
    """Checks each record batch against the configured schema, naming file, column and row."""

    def __init__(self, config: DataConfig) -> None:
        self.config = config

    def check_schema(self, path: Path, schema: pa.Schema) -> None:
        missing = [c for c in [self.config.label, *self.config.numeric, *self.config.categorical] if c not in schema.names]
        if missing:
            raise DataError(f"{path}: missing column(s) {missing}; present: {schema.names}")

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
        values = pc.cast(col, pa.float32()).to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
        # Nulls become NaN and are imputed with the train mean by preprocessing; Inf is an error.
        inf = np.isinf(values)
        if inf.any():
            i = int(np.flatnonzero(inf)[0])
            raise DataError(f"{path}: column '{name}' has an infinite value at row {first_row + i}")
        return values

    def label(self, path: Path, col: pa.Array, first_row: int) -> np.ndarray:
        name = self.config.label
        if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type) or pa.types.is_boolean(col.type)):
            raise DataError(f"{path}: label column '{name}' has type {col.type}, expected 0/1 integers")
        if col.null_count:
            i = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
            raise DataError(f"{path}: label column '{name}' is null at row {first_row + i}")
        values = pc.cast(col, pa.float64()).to_numpy(zero_copy_only=False)
        bad = ~((values == 0) | (values == 1))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise DataError(
                f"{path}: label column '{name}' must be 0 or 1, found {float(values[i])!r} at row {first_row + i}"
            )
        return values.astype(np.float32)


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

    def __init__(self, split: str, out_dir: Path, config: DataConfig, n_num: int, n_cat: int) -> None:
        self.split = split
        self.out_dir = out_dir
        self.rows_per_member = config.rows_per_member
        self.target_bytes = int(config.shard_size_mb * 1_000_000)
        self.n_num, self.n_cat = n_num, n_cat
        self.buffers: dict[str, list[np.ndarray]] = {"num": [], "cat": [], "label": []}
        self.buffered = 0
        self.shards: list[ShardInfo] = []
        self.member_index = 0
        self._file = None
        self._writer: ShardTarWriter | None = None
        self._hash = None
        self._rows_in_shard = 0
        self.rows = 0
        self.positives = 0

    def add(self, num: np.ndarray, cat: np.ndarray, label: np.ndarray) -> None:
        self.buffers["num"].append(num)
        self.buffers["cat"].append(cat)
        self.buffers["label"].append(label)
        self.buffered += len(label)
        while self.buffered >= self.rows_per_member:
            self._emit(self.rows_per_member)

    def _take(self, n: int) -> dict[str, np.ndarray]:
        merged = {k: np.concatenate(v) if len(v) > 1 else v[0] for k, v in self.buffers.items()}
        head = {k: v[:n] for k, v in merged.items()}
        rest = {k: v[n:] for k, v in merged.items()}
        self.buffers = {k: [v] if len(v) else [] for k, v in rest.items()}
        self.buffered -= n
        return head

    def _emit(self, n: int) -> None:
        block = self._take(n)
        key = f"b{self.member_index:08d}"
        payloads = [(f"{key}.{k}.npy", encode_npy(block[k])) for k in ("num", "cat", "label")]
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
        self.positives += int(block["label"].sum())

    def _open_shard(self) -> None:
        name = f"{self.split}-{len(self.shards):06d}.tar"
        self._file = open(self.out_dir / name, "wb")
        self._hashing = HashingWriter(self._file)
        self._writer = ShardTarWriter(self._hashing)  # type: ignore[arg-type]
        self._rows_in_shard = 0
        self._name = name

    def _close_shard(self) -> None:
        assert self._writer is not None and self._file is not None
        self._writer.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        size = self._file.tell()
        self._file.close()
        self.shards.append(ShardInfo(self._name, self.split, self._rows_in_shard, size, self._hashing.hexdigest()))
        self._writer = None
        self._file = None

    def finish(self) -> None:
        if self.buffered:
            self._emit(self.buffered)
        if self._writer is not None:
            self._close_shard()


def _iter_batches(path: Path, columns: list[str]) -> Iterator[pa.RecordBatch]:
    try:
        pf = pq.ParquetFile(path)
        yield from pf.iter_batches(batch_size=_READ_BATCH_ROWS, columns=columns)
    except (pa.ArrowInvalid, OSError) as err:
        raise DataError(f"{path}: not a readable Parquet file (truncated or corrupt?): {err}") from None


def dataset_fingerprint(files: list[Path], config: DataConfig) -> tuple[str, list[dict[str, object]]]:
    sources = [{"name": p.name, "bytes": p.stat().st_size, "sha256": _sha256_file(p)} for p in files]
    fp = fingerprint(
        "dataset", PACK_FORMAT_VERSION, [(s["bytes"], s["sha256"]) for s in sources],
        config.model_dump(mode="json", exclude={"source"}),
    )
    return fp, sources


def pack_shards(source: Path, config: DataConfig, datasets_root: Path) -> tuple[Path, DatasetManifest, bool]:
    """Validate and pack `source`; return (dataset dir, manifest, reused?).

    Reuses a complete dataset with the same fingerprint without writing anything.
    """
    files = source_files(source)
    fp, sources = dataset_fingerprint(files, config)
    final_dir = datasets_root / fp
    existing = load_manifest(final_dir)
    if existing is not None:
        return final_dir, existing, True

    validator = _Validator(config)
    columns = [config.label, *config.numeric, *config.categorical]
    for path in files:
        try:
            schema = pq.read_schema(path)
        except (pa.ArrowInvalid, OSError) as err:
            raise DataError(f"{path}: not a readable Parquet file (truncated or corrupt?): {err}") from None
        validator.check_schema(path, schema)

    datasets_root.mkdir(parents=True, exist_ok=True)
    work_dir = datasets_root / f"{fp}.partial-{os.getpid()}"
    shutil.rmtree(work_dir, ignore_errors=True)
    work_dir.mkdir()
    try:
        writers = {s: _SplitWriter(s, work_dir, config, len(config.numeric), len(config.categorical)) for s in SPLITS}
        row = 0
        for path in files:
            file_row = 0
            for batch in _iter_batches(path, columns):
                n = batch.num_rows
                label = validator.label(path, batch.column(config.label), file_row)
                num = np.empty((n, len(config.numeric)), dtype=np.float32)
                for j, name in enumerate(config.numeric):
                    num[:, j] = validator.numeric(path, name, batch.column(name), file_row)
                cat = np.empty((n, len(config.categorical)), dtype=np.int64)
                for j, name in enumerate(config.categorical):
                    cat[:, j] = category_hash(batch.column(name))
                split = _split_of_rows(row, n, config)
                for code, name in enumerate(SPLITS):
                    sel = split == code
                    if sel.any():
                        writers[name].add(num[sel], cat[sel], label[sel])
                row += n
                file_row += n
        if row == 0:
            raise DataError(f"{source}: the table is empty (0 rows)")
        for w in writers.values():
            w.finish()
        _check_splits(source, config, writers)
        manifest = DatasetManifest(
            fingerprint=fp,
            format_version=PACK_FORMAT_VERSION,
            label=config.label,
            numeric=list(config.numeric),
            categorical=list(config.categorical),
            rows={s: writers[s].rows for s in SPLITS},
            positives={s: writers[s].positives for s in SPLITS},
            shards=[shard for s in SPLITS for shard in writers[s].shards],
            sources=sources,
        )
        tmp = work_dir / "manifest.json.tmp"
        tmp.write_text(manifest.to_json())
        os.replace(tmp, work_dir / "manifest.json")
        try:
            os.rename(work_dir, final_dir)
        except OSError:
            # Another packer of the same input won the race; its dataset is identical.
            shutil.rmtree(work_dir, ignore_errors=True)
            if load_manifest(final_dir) is None:
                raise
    except BaseException:
        shutil.rmtree(work_dir, ignore_errors=True)
        raise
    return final_dir, manifest, False


def _check_splits(source: Path, config: DataConfig, writers: dict[str, _SplitWriter]) -> None:
    total_pos = sum(w.positives for w in writers.values())
    total = sum(w.rows for w in writers.values())
    if total_pos in (0, total):
        only = 1 if total_pos else 0
        raise DataError(
            f"{source}: label column '{config.label}' has only class {only}; training needs both 0 and 1"
        )
    for name, w in writers.items():
        if w.rows == 0:
            raise DataError(
                f"{source}: the {name} split is empty ({total} rows in all); add rows or raise data.{name}_fraction"
            )
    train = writers["train"]
    if train.positives in (0, train.rows):
        raise DataError(f"{source}: the train split of label '{config.label}' has a single class; add rows")
