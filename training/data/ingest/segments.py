"""Segments: a run of Parquet row groups of one source file, packed once into its own shards.

Layout, under `<root>/datasets/segments/<key>/`:

    train-000000.tar ...  validation-000000.tar ...  test-000000.tar ...
    stats.npz             the train rows' sufficient statistics (training.data.ingest.segment_stats)
    segment.json          written last; its presence marks the segment complete

The key is a content address: the data config, the file's name and schema, and for each row
group its metadata and the sha256 of its bytes (every byte the decoder read). So a segment is
packed once, by whichever machine gets to it first, and every dataset that holds the same rows
lists the same segment. A segment is written into `.partial-<id>/` and renamed into place with
its manifest inside, so a reader never sees half of one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field

from training.config import DataConfig, fingerprint, fingerprinted
from training.data.ingest.labels import SegmentClasses
from training.data.ingest.parquet_reader import ParquetRanges
from training.data.ingest.segment_stats import (
    SegmentStats,
    SegmentStatsBuilder,
    StatsDamage,
    parse_stats_arrays,
    stats_damage,
)
from training.data.ingest.sources import Source, SourceFile
from training.data.ingest.split_writer import SplitWriter
from training.data.ingest.splits import group_seed, split_of_keys, split_of_rows
from training.data.ingest.validation import FeatureValidator, category_hash, feature_arrays
from training.data.batch import present
from training.data.manifest import SPLITS, ShardInfo, is_segment_key
from training.data.shards import ShardReader
from training.errors import DataError, RetrainError, StorageError
from training.storage.files import is_plain_name, read_json, write_atomic, write_json_atomic

__all__ = ["SEGMENT_FORMAT", "PackedSegment", "SegmentManifest", "SegmentPlan", "check_segment", "first_damage", "load_segment",
           "pack_segment", "parse_segment", "plan_segments", "read_stats", "segment_columns", "split_of_file",
           "stats_file_damage"]

log = logging.getLogger(__name__)

SEGMENT_FORMAT = 2  # the pack format: 1 was whole-source datasets (training.data.manifest)
_READ_BATCH_ROWS = 65_536
STATS_FILE = "stats.npz"
MANIFEST = "segment.json"


class SegmentPlan(BaseModel):
    """A segment still to pack: consecutive row groups of one file (from its footer alone)."""

    model_config = ConfigDict(frozen=True)

    source: str  # data.source as `training.data.ingest.sources.open_source` reads it
    file: SourceFile
    row_groups: list[int]
    file_row: int  # the first row of the segment in its file
    rows: int


class SegmentManifest(BaseModel):
    """segment.json: what a segment holds. Everything in it is a function of the rows it was
    packed from, so the same rows give the same bytes on any machine."""

    model_config = ConfigDict(frozen=True)

    key: str
    format_version: int
    source: str  # the file's name in the source
    row_groups: list[int]
    file_row: int
    rows: dict[str, int]
    positives: dict[str, int]
    shards: list[ShardInfo]
    classes: list[Any] = []  # multiclass: the label value of each stored code
    class_rows: list[int] = []  # multiclass: the file row where each first appears
    train_classes: list[Any] = []  # multiclass: the values found in the train split
    vector_dims: list[int] = []
    time_range: list[float] | None = None  # data.time_column: oldest and newest, seconds since the epoch
    stats_bytes: int = 0
    stats_sha256: str = ""
    dropped_null_labels: int = Field(0, ge=0)  # rows left out for a null label (data.drop_null_labels)

    def to_bytes(self) -> bytes:
        return self.model_dump_json(indent=1).encode()


class PackedSegment(BaseModel):
    """What packing one segment hands back to the flow: small, whatever the segment's size."""

    model_config = ConfigDict(frozen=True)

    manifest: SegmentManifest
    source_bytes_read: int
    seconds: float
    reused: bool = False  # another packer had packed these very rows already
    uploaded_bytes: int = 0  # to an s3:// root

    @property
    def packed_bytes(self) -> int:
        """What the segment holds: shards, statistics and manifest."""
        m = self.manifest
        return sum(s.bytes for s in m.shards) + m.stats_bytes + len(m.to_bytes())


def segment_columns(config: DataConfig) -> list[str]:
    """The source columns packing reads."""
    columns = [config.label, *config.numeric_columns, *config.categorical, *config.vector, *config.text, *config.image]
    return columns + [c for c in (config.split_key, config.time_column) if c is not None and c not in columns]


def plan_segments(source: str, file: SourceFile, row_group_rows: list[int], segment_rows: int) -> list[SegmentPlan]:
    """The file's row groups in runs of at most `segment_rows` rows (a larger group alone)."""
    plans: list[SegmentPlan] = []
    groups: list[int] = []
    first = row = 0
    for group, n in enumerate(row_group_rows):
        if groups and sum(row_group_rows[g] for g in groups) + n > segment_rows:
            plans.append(SegmentPlan(source=source, file=file, row_groups=groups, file_row=first,
                                     rows=sum(row_group_rows[g] for g in groups)))
            groups, first = [], row
        if n:
            groups.append(group)
        else:
            first = row + n if not groups else first
        row += n
    if groups:
        plans.append(SegmentPlan(source=source, file=file, row_groups=groups, file_row=first, rows=sum(row_group_rows[g] for g in groups)))
    return plans


class _SegmentPacker:
    """The rows of one segment, batch by batch, into its split writers and statistics."""

    def __init__(self, config: DataConfig, plan: SegmentPlan, where: str, work_dir: Path) -> None:
        self.config, self.plan, self.where = config, plan, where
        self.validator = FeatureValidator(config)
        self.writers = {s: SplitWriter(s, work_dir, config) for s in SPLITS}
        self.stats = SegmentStatsBuilder(len(config.numeric_features), len(config.categorical), config.task == "regression",
                                         plan.rows)
        self.classes = SegmentClasses() if config.task == "multiclass" else None
        self.train_codes: set[int] = set()
        self.vector_dims: list[int] | None = None
        self.time_range: tuple[float, float] | None = None
        self.null_keys = 0  # rows whose data.split_key is null: they share one key, so one split
        self.dropped_null_labels = 0  # data.drop_null_labels: rows left out for a null label

    def add(self, batch: pa.RecordBatch, file_row: int, seed: int, group_row: int) -> None:
        """A record batch whose first row is `file_row` of the file and `group_row` of its row group."""
        if self.vector_dims is None:
            self.vector_dims = [_vector_dim(self.where, batch.column(name), name) for name in self.config.vector]
        # The split of every row first: it is a function of the row's place (or key), which a
        # dropped row must not shift for the rows after it.
        if self.config.split_key is not None:
            keys = batch.column(self.config.split_key)
            self.null_keys += keys.null_count
            split = split_of_keys(category_hash(keys), self.config)
        else:
            split = split_of_rows(seed, group_row, batch.num_rows, self.config)
        label_col = batch.column(self.config.label)
        if self.config.drop_null_labels and label_col.null_count:
            keep = label_col.is_valid()
            self.dropped_null_labels += label_col.null_count
            batch, split = batch.filter(keep), split[keep.to_numpy(zero_copy_only=False)]
            label_col = batch.column(self.config.label)
            if not batch.num_rows:
                return
        if self.classes is not None:
            label = self.classes.encode(self.where, self.config.label, label_col, file_row)
        else:
            label = self.validator.label(self.where, label_col, file_row, [])
        arrays = feature_arrays(self.validator, self.where, batch, file_row, self.vector_dims, file_row).with_label(label)
        if self.config.time_column is not None:
            self._time(batch.column(self.config.time_column))
        # One stable gather groups the rows by split, keeping their order within each.
        order = np.argsort(split, kind="stable")
        bounds = np.concatenate(([0], np.cumsum(np.bincount(split, minlength=len(SPLITS)))))
        arrays = arrays.take(order)
        labels = present(arrays.label, "label")
        for code, name in enumerate(SPLITS):
            a, b = int(bounds[code]), int(bounds[code + 1])
            if a == b:
                continue
            rows = arrays.slice(a, b)
            self.writers[name].add(rows)
            if name == "train":
                self.stats.add(rows.num, rows.cat, labels[a:b])
                if self.classes is not None:
                    self.train_codes.update(np.unique(labels[a:b]).tolist())

    def _time(self, col: pa.Array) -> None:
        found = self.validator.time_range(self.where, col)
        if found is not None:
            lo, hi = found if self.time_range is None else (min(found[0], self.time_range[0]),
                                                              max(found[1], self.time_range[1]))
            self.time_range = (lo, hi)

    def abort(self) -> None:
        for writer in self.writers.values():
            writer.abort()


def _vector_dim(where: str, col: pa.Array, name: str) -> int:
    """A vector column's length in this segment: its fixed size, or its first non-null row's (a
    null row is the validator's to name)."""
    if pa.types.is_fixed_size_list(col.type):
        return int(col.type.list_size)
    lengths = pc.list_value_length(col).drop_null()
    dim = int(lengths[0].as_py()) if len(lengths) else -1
    if dim == 0:
        raise DataError(f"{where}: vector column '{name}' holds empty lists")
    return dim


def pack_segment(source: Source, plan: SegmentPlan, config: DataConfig, segments_root: Path) -> PackedSegment:
    """Read, validate and pack one segment into `segments_root/<key>/`. Holds one record batch
    and one row group's bytes in memory at a time. Idempotent: a rerun writes the same key,
    and finds it there."""
    t0 = time.perf_counter()
    before = source.bytes_read
    ranges = ParquetRanges(source, plan.file)
    ranges_where = ranges.where
    FeatureValidator(config).check_schema(ranges_where, ranges.schema)
    segments_root.mkdir(parents=True, exist_ok=True)
    work_dir = segments_root / f".partial-{uuid.uuid4().hex[:12]}"
    work_dir.mkdir()
    packer = _SegmentPacker(config, plan, ranges_where, work_dir)
    try:
        groups = _pack_groups(ranges, plan, config, packer)
        for writer in packer.writers.values():
            writer.finish()
        manifest = _finish(packer, plan, config, ranges, groups, work_dir)
        reused = _publish(work_dir, segments_root / manifest.key)
    except BaseException:
        try:
            packer.abort()
        finally:
            shutil.rmtree(work_dir, ignore_errors=True)  # nothing of this attempt is left behind
        raise
    return PackedSegment(manifest=manifest, source_bytes_read=source.bytes_read - before,
                         seconds=time.perf_counter() - t0, reused=reused)


def _pack_groups(ranges: ParquetRanges, plan: SegmentPlan, config: DataConfig,
                 packer: _SegmentPacker) -> list[tuple[dict[str, Any], str]]:
    """Each row group read, hashed and packed; (its metadata, its sha256) for the segment's key."""
    groups = []
    file_row = plan.file_row
    columns = segment_columns(config)
    for group in plan.row_groups:
        digest = ranges.load_group(group)  # before decoding: the rows' split depends on it
        seed = group_seed(digest)
        expected = ranges.metadata.row_group(group).num_rows
        group_row = 0
        for batch in ranges.batches(group, columns, _READ_BATCH_ROWS):
            packer.add(batch, file_row + group_row, seed, group_row)
            group_row += batch.num_rows
        if group_row != expected:
            raise DataError(f"{ranges.where}: row group {group} holds {group_row} rows, its metadata says {expected}")
        groups.append((ranges.group_metadata(group), digest))
        file_row += group_row
    return groups


def _finish(packer: _SegmentPacker, plan: SegmentPlan, config: DataConfig, ranges: ParquetRanges,
            groups: list[tuple[dict[str, Any], str]], work_dir: Path) -> SegmentManifest:
    """The statistics, the key and the manifest (last) in the work folder."""
    stats = packer.stats.finish().to_bytes()
    write_atomic(work_dir / STATS_FILE, stats)
    if packer.null_keys:
        to = SPLITS[int(split_of_keys(np.zeros(1, dtype=np.int64), config)[0])]
        log.warning("%s: data.split_key '%s' is null in %d of %d rows: they share one key, so all of them went "
                    "to the %s split", packer.where, config.split_key, packer.null_keys, plan.rows, to)
    if packer.dropped_null_labels:
        log.warning("%s: %d of %d rows left out: their label '%s' is null (data.drop_null_labels)", packer.where,
                 packer.dropped_null_labels, plan.rows, config.label)
    view = fingerprinted(config)
    view.pop("window", None)  # a window chooses segments; it does not change them
    key = fingerprint("segment", SEGMENT_FORMAT, view, plan.file.name, ranges.schema_text, groups,
                      ranges.outside_digest)
    classes = packer.classes.values if packer.classes is not None else []
    manifest = SegmentManifest(
        key=key, format_version=SEGMENT_FORMAT, source=plan.file.name, row_groups=plan.row_groups,
        file_row=plan.file_row, rows={s: w.rows for s, w in packer.writers.items()},
        positives={s: w.positives for s, w in packer.writers.items()},
        shards=[shard for s in SPLITS for shard in packer.writers[s].shards],
        classes=classes, class_rows=packer.classes.first_rows if packer.classes is not None else [],
        train_classes=sorted(classes[c] for c in packer.train_codes),
        vector_dims=packer.vector_dims or [], time_range=list(packer.time_range) if packer.time_range else None,
        stats_bytes=len(stats), stats_sha256=hashlib.sha256(stats).hexdigest(),
        dropped_null_labels=packer.dropped_null_labels)
    write_atomic(work_dir / MANIFEST, manifest.to_bytes())
    return manifest


def _publish(work_dir: Path, final_dir: Path) -> bool:
    """Rename the finished work folder into place; True when the segment was there already."""
    try:
        os.rename(work_dir, final_dir)
        record_verified(final_dir)  # hashed as they were written: they verify now, by construction
        return False
    except OSError:
        shutil.rmtree(work_dir, ignore_errors=True)  # another packer of the same rows won: identical
        if not (final_dir / MANIFEST).exists():
            raise StorageError(f"cannot move the packed segment into {final_dir}; remove that folder and run "
                               "the same command again") from None
        return True


def load_segment(segment_dir: Path) -> SegmentManifest | None:
    """A complete segment's manifest (None when absent or incomplete), its names checked."""
    path = segment_dir / MANIFEST
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise DataError(f"{path} is unreadable ({err.strerror or err})") from None
    return parse_segment(data, segment_dir.name, str(path))


def parse_segment(data: bytes, key: str, where: str) -> SegmentManifest:
    """segment.json of segment `key`, checked: whoever can write the storage root writes
    manifests too, so its key must be its folder's and its shards plain `.tar` names."""
    try:
        manifest = SegmentManifest.model_validate_json(data)
    except ValueError as err:
        raise DataError(f"{where} is unreadable ({str(err).splitlines()[0]})") from None
    return check_segment(manifest, key, where)


def check_segment(manifest: SegmentManifest, key: str, where: str) -> SegmentManifest:
    """A segment.json read from the root, checked (see `parse_segment`)."""
    if manifest.key != key or not is_segment_key(manifest.key):
        raise DataError(f"{where} names segment {manifest.key!r}, not its folder's {key!r}: damaged or tampered with")
    for shard in manifest.shards:
        if not (is_plain_name(shard.name) and shard.name.endswith(".tar") and shard.split in SPLITS):
            raise DataError(f"{where} lists a shard that is not a file of the segment ({shard.name!r}): damaged "
                            "or tampered with")
    for split in SPLITS:
        in_shards = sum(s.rows for s in manifest.shards if s.split == split)
        if manifest.rows.get(split) != in_shards or manifest.positives.get(split, 0) < 0:
            raise DataError(f"{where} counts {manifest.rows.get(split)} {split} rows where its shards hold "
                            f"{in_shards}: damaged or tampered with")
    return manifest


def stats_file_damage(segment_dir: Path, manifest: SegmentManifest) -> str | None:
    """Why the local stats.npz of a segment cannot be used (None: it can): missing, not the
    bytes its manifest's sha256 names, or not statistics packing could have written (a value
    that is not finite, a negative count, a missing array, a row count that is not the
    segment's)."""
    path = segment_dir / STATS_FILE
    record_path = _verified_record(segment_dir)
    try:
        st = path.stat()
        verified = read_json(record_path) or {}
    except OSError as err:
        return f"{path} is unreadable ({err.strerror or err})"
    except RetrainError:
        verified = {}
    stamp = [st.st_size, st.st_mtime_ns]
    if verified.get(STATS_FILE) == stamp:
        return None  # checked at this size and mtime before: a reuse costs a stat, as for shards
    try:
        data = path.read_bytes()
    except OSError as err:
        return f"{path} is unreadable ({err.strerror or err})"
    if hashlib.sha256(data).hexdigest() != manifest.stats_sha256:
        return f"{path} does not match its sha256 in {MANIFEST} (corrupt)"
    try:
        problem = stats_damage(parse_stats_arrays(data), train_rows=manifest.rows.get("train"))
    except StatsDamage as err:
        problem = str(err)
    if problem is not None:
        return f"{path}: {problem} (damaged or tampered with)"
    _write_record(record_path, {**verified, STATS_FILE: stamp})
    return None


def read_stats(segment_dir: Path, manifest: SegmentManifest, categorical: int, regression: bool) -> SegmentStats:
    """The segment's statistics, checked against their sha256 in its manifest (downloaded first
    when the segment's files are on S3)."""
    from training.data.load.shard_cache import local_shard

    path, _ = local_shard(segment_dir, STATS_FILE, manifest.stats_bytes, manifest.stats_sha256)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise DataError(f"{path} is unreadable ({err.strerror or err}); run the same command again: the pack stage "
                        "packs the segment again") from None
    again = "run the same command again: the pack stage packs the segment again"
    if hashlib.sha256(data).hexdigest() != manifest.stats_sha256:
        raise DataError(f"{path} does not match its sha256 in {MANIFEST} (corrupt); {again}")
    try:
        return SegmentStats.from_bytes(data, categorical, regression)
    except StatsDamage as err:
        raise DataError(f"{path}: {err} (damaged or tampered with); {again}") from None


def _verified_record(segment_dir: Path) -> Path:
    return segment_dir.with_name(f".{segment_dir.name}.verified.json")


def first_damage(segment_dir: Path, shards: list[ShardInfo]) -> str | None:
    """Why a local folder of shards (a segment's, or a format-1 dataset's) cannot be used (None:
    it can). Shards whose size or mtime changed since they last verified (all of them the first
    time) are hashed and their members checked; a reuse costs a stat per shard."""
    record_path = _verified_record(segment_dir)
    try:
        verified = read_json(record_path) or {}
    except RetrainError:
        verified = {}
    current: dict[str, list[int]] = {}
    for shard in shards:
        path = segment_dir / shard.name
        try:
            st = path.stat()
        except FileNotFoundError:
            return f"{segment_dir}: shard {shard.name} is missing"
        current[shard.name] = [st.st_size, st.st_mtime_ns]
        if verified.get(shard.name) == current[shard.name]:
            continue
        if st.st_size != shard.bytes or not shard.checksum.matches_file(path):
            return f"{segment_dir}: shard {shard.name} does not match its {shard.checksum.algorithm} in the manifest (corrupt)"
        reader = ShardReader(path)
        try:
            reader.check_members()  # a hash proves the bytes are the manifest's, not that packing wrote them
        except DataError as err:
            return str(err)
        finally:
            reader.close()
    if any(verified.get(name) != stamp for name, stamp in current.items()):
        _write_record(record_path, {**verified, **current})
    return None


def _write_record(record_path: Path, stamps: dict[str, Any]) -> None:
    try:
        write_json_atomic(record_path, stamps)
    except OSError:
        pass  # a read-only root: verified again next time


def record_verified(segment_dir: Path) -> None:
    """Record the segment's shards as verified at their current size and mtime."""
    files = [*segment_dir.glob("*.tar"), *([segment_dir / STATS_FILE] if (segment_dir / STATS_FILE).exists() else [])]
    _write_record(_verified_record(segment_dir), {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files})


def forget_verification(segment_dir: Path) -> None:
    """The next reuse hashes every shard of the segment again (a reader found one damaged)."""
    _verified_record(segment_dir).unlink(missing_ok=True)


def split_of_file(path: Path, config: DataConfig) -> np.ndarray:
    """The split code (`training.data.ingest.splits.SPLIT_CODES`) of every row of a local Parquet file,
    as packing assigns them: to find a split's rows in a source."""
    from training.data.ingest.sources import LocalSource

    source = LocalSource(path)
    ranges = ParquetRanges(source, source.files()[0])
    out = []
    for group, rows in enumerate(ranges.row_group_rows):
        if config.split_key is not None:
            ranges.load_group(group)
            keys = [b.column(0) for b in ranges.batches(group, [config.split_key], _READ_BATCH_ROWS)]
            out += [split_of_keys(category_hash(k), config) for k in keys]
        else:
            out.append(split_of_rows(group_seed(ranges.load_group(group)), 0, rows, config))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int8)
