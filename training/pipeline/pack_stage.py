"""The pack stage: the source's Parquet into a dataset of content-addressed segments.

`pack_begin` checks the storage root, lists the source and plans what is missing (a file seen
before costs a look-up: `training.data.ingest.packing`); `pack_segment_stage` packs one segment,
serially here or fanned out by the flow, and publishes it to the root on its own (so a worker
on another machine needs no shared folder); `pack_finish` lists the segments in the dataset's
manifest and lets retention remove what no kept dataset lists.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from training.config import RetrainConfig
from training.data.ingest.dataset_store import DatasetStore
from training.data.ingest.demo import DEMOS, ensure_demo_dataset
from training.data.ingest.packing import FilesPlanned, PackPlan, assemble_dataset, plan_files, plan_pack
from training.data.ingest.segments import PackedSegment, SegmentPlan, pack_segment
from training.data.ingest.sources import SourceFile, open_source
from training.data.manifest import DatasetManifest
from training.errors import DataError
from training.pipeline.handoffs import PackResult
from training.storage.root import StorageRoot, StorageSummary
from training.copies import updated

log = logging.getLogger(__name__)

__all__ = ["PackBegun", "pack_begin", "pack_finish", "pack_segment_stage", "pack_stage", "plan_files_stage", "resolve_source",
           "with_planned"]


class PackBegun(BaseModel):
    """The pack stage's first step: the plan, and the dataset when nothing is left to pack."""

    model_config = ConfigDict(frozen=True)

    source: str
    storage: StorageSummary
    bayes_auc: float | None
    started_at: float
    plan: PackPlan
    done: PackResult | None = None


def resolve_source(config: RetrainConfig, root: StorageRoot) -> tuple[str, float | None]:
    """data.source as packing reads it (a demo written first), and the demo's Bayes AUC."""
    if config.data.source is None:
        path, bayes_auc = ensure_demo_dataset(root.local)
        return str(path), bayes_auc
    if config.data.source in DEMOS:
        return str(DEMOS[config.data.source](root.local)), None
    spec = config.data.source
    return (spec if spec.startswith("s3://") else str(Path(spec).expanduser())), None


def pack_begin(config: RetrainConfig, defer_footers: bool = False) -> PackBegun:
    """Check storage, list the source and plan the segments still to pack (with
    `defer_footers`, new files are left in `plan.unread`, for `plan_files_stage`)."""
    started = time.time()
    root = StorageRoot.from_config(config)
    storage = root.prepare()  # fail here, not mid-training
    source, bayes_auc = resolve_source(config, root)
    store = DatasetStore(root)
    plan, legacy = plan_pack(source, config.data, store, config.storage, read_footers=not defer_footers)
    begun = PackBegun(source=source, storage=storage, bayes_auc=bayes_auc, started_at=started, plan=plan)
    if legacy is not None:
        return updated(begun, {"done": _packed(begun, root, legacy, [], store, reused=True)})
    if not plan.todo and not plan.unread:
        return updated(begun, {"done": _finish(config, begun, [], root, store)})
    return begun


def plan_files_stage(config: RetrainConfig, source: str, files: list[SourceFile]) -> FilesPlanned:
    """The segments of new files, from their footers, read here (a cluster's worker)."""
    return plan_files(source, files, config.data, config.storage)


def with_planned(begun: PackBegun, planned: list[FilesPlanned]) -> PackBegun:
    """The plan with its unread files' segments, as `plan_files_stage` planned them."""
    plan = begun.plan
    todo = [*plan.todo, *(p for done in planned for p in done.todo)]
    if not plan.ready and not todo:
        raise DataError(f"{plan.source}: the table is empty (0 rows)")
    return updated(begun, {"plan": updated(plan, {
        "todo": todo, "unread": [], "source_bytes_read": plan.source_bytes_read + sum(p.source_bytes_read for p in planned)})})


def pack_segment_stage(config: RetrainConfig, plan: SegmentPlan) -> PackedSegment:
    """Pack one segment and publish it to the root (small result: its manifest)."""
    store = DatasetStore(StorageRoot.from_config(config))
    done = pack_segment(open_source(plan.source, config.storage), plan, config.data, store.segments_root())
    return updated(done, {"uploaded_bytes": store.publish_segment(done.manifest)})


def pack_finish(config: RetrainConfig, begun: PackBegun, packed: list[PackedSegment]) -> PackResult:
    """The dataset of every segment (the reused one when nothing was packed)."""
    if begun.done is not None:
        return updated(begun.done, {"seconds": time.time() - begun.started_at})
    root = StorageRoot.from_config(config)
    return _finish(config, begun, packed, root, DatasetStore(root))


def _finish(config: RetrainConfig, begun: PackBegun, packed: list[PackedSegment], root: StorageRoot,
            store: DatasetStore) -> PackResult:
    manifest = assemble_dataset(begun.plan, packed, config.data, store)
    removed = store.retain(manifest.fingerprint, config.storage.keep_datasets)
    if removed:
        log.info("retention: removed %d segment(s) no kept dataset lists", len(removed))
    return _packed(begun, root, manifest, packed, store, reused=not packed, removed=len(removed))


def _packed(begun: PackBegun, root: StorageRoot, manifest: DatasetManifest, packed: list[PackedSegment],
            store: DatasetStore, reused: bool, removed: int = 0) -> PackResult:
    return PackResult(
        source=begun.source, dataset_dir=str(store.local_root() / manifest.fingerprint),
        dataset_uri=root.display(f"datasets/{manifest.fingerprint}"), fingerprint=manifest.fingerprint,
        rows=manifest.rows, shards=len(manifest.shards), reused=reused,
        uploaded_bytes=store.uploaded_bytes + sum(p.uploaded_bytes for p in packed), storage=begun.storage,
        bayes_auc=begun.bayes_auc, started_at=begun.started_at, seconds=time.time() - begun.started_at,
        parts=len(packed) or None, format_version=manifest.format_version, segments=len(manifest.segments),
        segments_packed=sum(1 for p in packed if not p.reused),
        source_bytes_read=begun.plan.source_bytes_read + sum(p.source_bytes_read for p in packed),
        packed_bytes=sum(p.packed_bytes for p in packed if not p.reused), segments_removed=removed,
        dataset_bytes=sum(s.bytes for s in manifest.shards),
        dropped_null_labels=sum(s.dropped_null_labels for s in manifest.segments),
    )


def pack_stage(config: RetrainConfig) -> PackResult:
    """The whole pack stage in this process: begin, every segment in turn, finish."""
    begun = pack_begin(config)
    if begun.done is not None:
        return pack_finish(config, begun, [])
    return pack_finish(config, begun, [pack_segment_stage(config, plan) for plan in begun.plan.todo])
