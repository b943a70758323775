"""A dataset from its source: the segments it needs, the missing ones packed, its manifest.

`plan_pack` lists the source and, for each file, finds its segments in the source index
(`training.data.ingest.source_index`) and the store: a file seen before costs a lookup, a new file
costs reading its footer. What is missing becomes a `SegmentPlan` (a run of row groups), packed
by `pack_segment` anywhere (serially here, or one task each on the flow's task runner).
`assemble_dataset` lists the segments (within `data.window`) in `datasets/<fingerprint>/manifest.json`,
whose fingerprint is that of the list: the same segments are the same dataset, on any machine.

A format-1 dataset (whole-source shards, written by earlier versions) of this very source and
config is used as it is, so an upgrade neither repacks nor restarts a run; once the source
changes, the dataset is packed as segments, which a log line says.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from training.config import DataConfig, StorageConfig
from training.data.ingest.dataset_store import DatasetStore
from training.data.ingest.labels import LABELS, Classes
from training.data.ingest.parquet_reader import ParquetRanges
from training.data.ingest.segments import (
    SEGMENT_FORMAT,
    PackedSegment,
    SegmentManifest,
    SegmentPlan,
    first_damage,
    pack_segment,
    plan_segments,
)
from training.data.ingest.source_index import (
    WHOLE_FILE,
    IndexedSegment,
    SourceIndex,
    dataset_fingerprint,
    known_fingerprints,
    legacy_fingerprint,
    segment_config_key,
    window,
)
from training.data.ingest.sources import LocalSource, S3Source, Source, SourceFile, open_source
from training.data.ingest.validation import FeatureValidator
from training.data.manifest import SPLITS, DatasetManifest, SegmentRef, ShardInfo, load_manifest
from training.errors import DataError
from training.storage.files import sha256_file
from training.storage.root import StorageRoot
from training.copies import updated

log = logging.getLogger(__name__)

__all__ = ["PACK_FORMAT_VERSION", "FilesPlanned", "PackPlan", "assemble_dataset", "dataset_of", "forget_verification",
           "pack_local", "pack_serially", "plan_files", "plan_pack"]

PACK_FORMAT_VERSION = SEGMENT_FORMAT
PLAN_THREADS = 16  # footers and segment.json files read at once while planning


class PackPlan(BaseModel):
    """What a pack needs, decided from the source's listing, the index and footers alone."""

    model_config = ConfigDict(frozen=True)

    source: str
    files: list[SourceFile]
    ready: list[SegmentManifest]  # segments already packed, here or on S3
    todo: list[SegmentPlan]  # segments to pack
    source_bytes_read: int = 0  # footers of new files, read to plan them
    # New files whose footers the plan left unread, for `plan_files` where the segments are
    # packed (a cluster's workers): with read_footers=False.
    unread: list[SourceFile] = []


class FilesPlanned(BaseModel):
    """The segments of new files, planned from their footers (`plan_files`)."""

    model_config = ConfigDict(frozen=True)

    todo: list[SegmentPlan]
    source_bytes_read: int


def plan_pack(spec: str | Path, config: DataConfig, store: DatasetStore, storage: StorageConfig | None = None,
              read_footers: bool = True) -> tuple[PackPlan, DatasetManifest | None]:
    """The plan, and a format-1 dataset of this very source and config when one is here (then
    nothing is packed: see the module docstring). With `read_footers` False, new files are left
    in `unread` for `plan_files`."""
    source = open_source(spec, storage)
    files = source.files()
    index = store.index()
    legacy = _legacy_dataset(source, files, config, store, index)
    if legacy is not None:
        return PackPlan(source=source.uri, files=files, ready=[], todo=[]), legacy
    ckey = segment_config_key(config)
    validator = FeatureValidator(config)
    if store.root.remote is not None:
        # A fresh machine knows the segments from one catalog: the dataset the index predicts,
        # else the newest on the root (a source that grew by a file shares the rest with it).
        if not any(store.prime_catalog(fp) for fp in sorted(known_fingerprints(index, config, source.uri, files))):
            store.prime_catalog()

    def plan_file(file: SourceFile) -> tuple[list[SegmentManifest], list[SegmentPlan], list[SourceFile]]:
        entry = index.lookup(ckey, source.uri, file)
        indexed = None if entry is None else _indexed_segments(entry.segments, file, store)
        if indexed is not None:
            return indexed, [], []
        if not read_footers:
            return [], [], [file]
        return [], _plan_new_file(source, file, config, validator), []

    ready: list[SegmentManifest] = []
    todo: list[SegmentPlan] = []
    unread: list[SourceFile] = []
    # Each file costs a round trip or two on S3 (its footer, or its segments' segment.json), so
    # they are asked PLAN_THREADS at a time; results come back in the files' order, and the first
    # file that fails in that order is the error, as one by one.
    with ThreadPoolExecutor(max_workers=PLAN_THREADS, thread_name_prefix="pack-plan") as pool:
        for found, planned, left in pool.map(plan_file, files):
            ready += found
            todo += planned
            unread += left
    if not ready and not todo and not unread:
        raise DataError(f"{source.uri}: the table is empty (0 rows)")
    return PackPlan(source=source.uri, files=files, ready=ready, todo=todo, source_bytes_read=source.bytes_read,
                    unread=unread), None


def _plan_new_file(source: Source, file: SourceFile, config: DataConfig, validator: FeatureValidator
                   ) -> list[SegmentPlan]:
    """A new file's segments, from its footer; its schema checked first, so a wrong file fails
    before anything is packed."""
    ranges = ParquetRanges(source, file)
    validator.check_schema(ranges.where, ranges.schema)
    return plan_segments(source.uri, file, ranges.row_group_rows, config.segment_rows)


def plan_files(spec: str, files: list[SourceFile], config: DataConfig,
               storage: StorageConfig | None = None) -> FilesPlanned:
    """The segments of `files` (a plan's `unread`), from their footers, PLAN_THREADS at a time,
    in the files' order: what a cluster's worker runs, so the flow's machine reads no footer."""
    source = open_source(spec, storage)
    validator = FeatureValidator(config)
    with ThreadPoolExecutor(max_workers=PLAN_THREADS, thread_name_prefix="plan-files") as pool:
        todo = [plan for planned in pool.map(lambda f: _plan_new_file(source, f, config, validator), files)
                for plan in planned]
    return FilesPlanned(todo=todo, source_bytes_read=source.bytes_read)


def _indexed_segments(entry: list[IndexedSegment], file: SourceFile, store: DatasetStore
                      ) -> list[SegmentManifest] | None:
    """The segments the source index records for `file`, each available and checked against
    its own segment.json, which records the file and row groups it was packed from; None when
    the file must be read again: a segment is gone or damaged, or the entry does not hold up
    (the index is in the storage root, which is input from whoever can write it)."""
    if not entry:
        return None  # an empty file, or an entry emptied: its footer says which
    found = []
    for seg in entry:
        segment = store.available_segment(seg.key)
        if segment is None:
            return None  # packed again from the file's own footer, never from the entry's row groups
        if (segment.source, segment.row_groups, segment.file_row) != (file.name, seg.row_groups, seg.file_row):
            log.warning("the source index's entry for %s names segment %s, which holds %s row groups %s: "
                        "damaged or tampered with; reading the file again", file.name, seg.key, segment.source,
                        segment.row_groups)
            return None
        found.append(segment)
    return found


def pack_serially(plan: PackPlan, config: DataConfig, store: DatasetStore,
                  storage: StorageConfig | None = None) -> tuple[DatasetManifest, list[PackedSegment]]:
    """Every planned segment packed here, in order, then the dataset assembled."""
    source = open_source(plan.source, storage)
    packed = []
    for segment in plan.todo:
        done = pack_segment(source, segment, config, store.segments_root())
        packed.append(updated(done, {"uploaded_bytes": store.publish_segment(done.manifest)}))
    return assemble_dataset(plan, packed, config, store), packed


def pack_local(source: Path, config: DataConfig, datasets_root: Path) -> tuple[Path, DatasetManifest, bool]:
    """Pack `source` into `datasets_root` (the `datasets` folder of a local storage root) in this
    process: (dataset folder, manifest, whether nothing had to be packed)."""
    store = DatasetStore(StorageRoot(StorageConfig(root=str(datasets_root.parent))))
    plan, legacy = plan_pack(source, config, store)
    if legacy is not None:
        return datasets_root / legacy.fingerprint, legacy, True
    manifest, _ = pack_serially(plan, config, store)
    return datasets_root / manifest.fingerprint, manifest, not plan.todo


def assemble_dataset(plan: PackPlan, packed: list[PackedSegment], config: DataConfig,
                     store: DatasetStore) -> DatasetManifest:
    """The dataset of the plan's ready segments and the ones just packed (anywhere), within
    `data.window`: its manifest written here and on S3, and the source index updated."""
    for done in packed:
        store.adopt_segment(done.manifest)
    # In the source's order, whatever order the segments were packed in: the catalog's bytes
    # are the same on any machine, at any parallelism.
    order = {f.name: i for i, f in enumerate(plan.files)}
    segments = sorted({s.key: s for s in [*plan.ready, *(p.manifest for p in packed)]}.values(),
                      key=lambda s: (order.get(s.source, -1), s.file_row))
    _remember(plan, segments, config, store)
    manifest = dataset_of(plan, segments, config)
    store.write_dataset(manifest, segments)
    return manifest


def dataset_of(plan: PackPlan, segments: list[SegmentManifest], config: DataConfig) -> DatasetManifest:
    """The manifest of the dataset these segments make (within `data.window`), checked as a
    whole; written nowhere."""
    order = {f.name: i for i, f in enumerate(plan.files)}
    segments = sorted({s.key: s for s in segments}.values(), key=lambda s: (order.get(s.source, -1), s.file_row))
    chosen = window(segments, config)
    untimed = [s for s in segments if s.time_range is None]
    if config.window.last_days is not None and config.time_column is not None and untimed:
        files = sorted({s.source for s in untimed})
        log.warning("data.window.last_days: %d rows of %s have no time (data.time_column '%s' is null in all of "
                    "them) and are left out", sum(sum(s.rows.values()) for s in untimed),
                    ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else ""), config.time_column)
    return _manifest(plan.source, chosen, plan.files, config)


def _remember(plan: PackPlan, segments: list[SegmentManifest], config: DataConfig, store: DatasetStore) -> None:
    """Record each file's segments in the source index, under its identity."""
    ckey = segment_config_key(config)
    by_file: dict[str, list[SegmentManifest]] = {}
    for segment in segments:
        by_file.setdefault(segment.source, []).append(segment)

    def record(index: SourceIndex) -> None:
        for file in plan.files:
            found = sorted(by_file.get(file.name, []), key=lambda s: s.file_row)
            index.record(ckey, plan.source, file, [
                IndexedSegment(key=s.key, row_groups=s.row_groups, file_row=s.file_row, rows=sum(s.rows.values()),
                               time_range=s.time_range) for s in found])
        index.forget_missing(ckey, plan.source, plan.files)

    store.update_index(record)


def _manifest(source: str, segments: list[SegmentManifest], files: list[SourceFile],
              config: DataConfig) -> DatasetManifest:
    """The dataset manifest of `segments`, checked as a whole: every split holds rows, the label
    can be trained and evaluated, vectors have one length."""
    rows = {s: sum(seg.rows[s] for seg in segments) for s in SPLITS}
    positives = {s: sum(seg.positives[s] for seg in segments) for s in SPLITS}
    classes = _dataset_classes(segments, config)
    dims = _vector_dims(segments, config)
    keys = [s.key for s in segments]
    fp = dataset_fingerprint(keys, config)
    keys_of: dict[str, list[str]] = {f.name: [] for f in files}
    for seg in segments:  # one pass: a source of thousands of files is common
        keys_of.setdefault(seg.source, []).append(seg.key)
    manifest = DatasetManifest(
        fingerprint=fp, format_version=SEGMENT_FORMAT, label=config.label, numeric=list(config.numeric_features),
        categorical=list(config.categorical), rows=rows, positives=positives,
        shards=[ShardInfo(sh.name, sh.split, sh.rows, sh.bytes, sh.sha256, sh.xxh3_128, seg.key)
                for seg in segments for sh in seg.shards],
        sources=[{"name": f.name, "bytes": f.size, "segments": keys_of[f.name]} for f in files if keys_of[f.name]],
        task=config.task, classes=classes, vector=list(config.vector), vector_dims=dims, text=list(config.text),
        image=list(config.image), source=source,
        segments=[SegmentRef(s.key, s.source, s.row_groups, s.file_row, s.rows, list(s.classes), list(s.class_rows),
                             s.dropped_null_labels) for s in segments],
    )
    _check(source, manifest, config)
    return manifest


def _dataset_classes(segments: list[SegmentManifest], config: DataConfig) -> Classes:
    """The sorted classes of the train split. A label stored as integers in one file and as
    strings in another has no order (and `1` is not `"1"`): one line naming both files."""
    kinds: dict[type, str] = {}
    for seg in segments:
        for value in seg.train_classes:
            kinds.setdefault(type(value), seg.source)
    if len(kinds) > 1:
        (one, first), (other, second) = list(kinds.items())[:2]
        raise DataError(f"label column '{config.label}' holds {one.__name__} values in {first} and "
                        f"{other.__name__} values in {second}; store it as one type in every file")
    return sorted({c for seg in segments for c in seg.train_classes})


def _vector_dims(segments: list[SegmentManifest], config: DataConfig) -> list[int]:
    dims = next((s.vector_dims for s in segments if s.vector_dims), [])
    for seg in segments:
        for name, mine, theirs in zip(config.vector, seg.vector_dims, dims, strict=False):
            if mine != theirs and mine > 0:
                raise DataError(f"{seg.source}: vector column '{name}' has length {mine}; the other files' have "
                                f"{theirs}: every row needs the same length")
    return dims


def _check(source: str, manifest: DatasetManifest, config: DataConfig) -> None:
    LABELS[config.task].check_splits(Path(source), config.label, manifest.rows, manifest.positives,
                                     manifest.classes)
    for name, n in manifest.rows.items():
        if n == 0:
            raise DataError(f"{source}: the {name} split is empty ({sum(manifest.rows.values())} rows in all); add "
                            f"rows, widen data.window or raise data.{name}_fraction")
    if config.task == "multiclass":
        for ref in manifest.segments:
            manifest.segment_label_map(ref)  # a value that is no class of the train split: one error


# -- format 1 ------------------------------------------------------------------------------------

def _legacy_dataset(source: LocalSource | S3Source, files: list[SourceFile], config: DataConfig,
                    store: DatasetStore, index: SourceIndex) -> DatasetManifest | None:
    """A complete format-1 dataset of this source and config, when this root holds any."""
    if not isinstance(source, LocalSource):
        return None
    old = [p.parent for p in store.local_root().glob("*/manifest.json") if _format(p) == 1]
    if not old:
        return None
    hashes = []
    for file in files:
        entry = index.lookup(WHOLE_FILE, source.uri, file)
        hashes.append(entry.sha256 if entry is not None else sha256_file(Path(source.where(file.name))))

    def record(index: SourceIndex) -> None:
        for file, sha in zip(files, hashes, strict=True):
            index.record(WHOLE_FILE, source.uri, file, [], sha)

    store.update_index(record)
    fp = legacy_fingerprint([f.size for f in files], hashes, config)
    folder = store.local_root() / fp
    if folder not in old:
        log.warning("%s holds datasets packed by an earlier version; the source changed since, so it is packed "
                    "again, as segments: from now on only new files are packed", store.local_root())
        return None
    try:
        manifest = load_manifest(folder)
        damage = None if manifest is None else first_damage(folder, manifest.shards)
    except DataError as err:
        manifest, damage = None, str(err)
    if manifest is None or damage is not None:
        log.warning("%s; packing the source again, as segments", damage or f"{folder} is incomplete")
        return None
    return manifest


def _format(path: Path) -> int:
    try:
        return int(DatasetManifest.from_json(path.read_bytes(), str(path)).format_version)
    except (DataError, OSError):
        return 0


def forget_verification(dataset_dir: Path) -> None:
    """Make the next pack stage hash every shard of the dataset again (a reader found one
    damaged that its record said was verified): it then finds it and packs it again."""
    from training.data.ingest.segments import forget_verification as forget_segment
    from training.data.manifest import segments_dir

    forget_segment(dataset_dir)  # a format-1 dataset's own shards
    try:
        manifest = load_manifest(dataset_dir)
    except DataError:
        return
    for ref in manifest.segments if manifest is not None else []:
        forget_segment(segments_dir(dataset_dir) / ref.key)
