"""The pack stage: the source's Parquet into a content-addressed dataset of WebDataset shards.

`pack_begin` checks the storage root and finds a dataset packed before (here or on S3) or plans
the parts; `pack_part_stage` packs one part (a run of Parquet row groups), serially here or
fanned out by the flow; `pack_finish` assembles the shards, manifest last, and publishes them.
The shards' bytes do not depend on how the parts were packed.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from training.config import DataConfig, RetrainConfig
from training.data.dataset_store import DatasetStore
from training.data.demo import DEMOS, ensure_demo_dataset
from training.data.packing import (DatasetManifest, PackedPart, PackPart, PackPlan, assemble_shards, pack_part,
                                   pack_serially, plan_pack, require_manifest, start_pack)
from training.data.sources import dataset_fingerprint, source_files
from training.pipeline.handoffs import PackResult
from training.storage.root import StorageRoot

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


class PackBegun(BaseModel):
    """The pack stage's first step: the reused dataset (`done`), or the plan, whose parts
    `pack_part_stage` packs, serially here or fanned out by the flow."""

    model_config = ConfigDict(frozen=True)

    source: str
    storage: dict[str, Any]  # where the root is (StorageRoot.environment_summary; never credentials)
    bayes_auc: float | None
    started_at: float
    done: PackResult | None = None
    plan: PackPlan | None = None


def pack_begin(config: RetrainConfig) -> PackBegun:
    """Check storage, find an already packed dataset (here or on S3), or plan the packing."""
    started = time.time()
    root = StorageRoot.from_config(config)
    storage = {**root.environment_summary(), **root.prepare()}  # fail here, not mid-training
    bayes_auc = None
    if config.data.source is None:
        source, bayes_auc = ensure_demo_dataset(root.local)
    elif config.data.source in DEMOS:
        source = DEMOS[config.data.source](root.local)
    else:
        source = Path(config.data.source).expanduser()
    begun = PackBegun(source=str(source), storage=storage, bayes_auc=bayes_auc, started_at=started)
    datasets = DatasetStore(root)
    if root.is_remote:
        fp, _ = dataset_fingerprint(source_files(source), config.data)
        dataset_dir = datasets.fetch(fp)  # packed before, on any machine
        if dataset_dir is not None:
            packed = _packed(begun, root, dataset_dir, require_manifest(dataset_dir), reused=True, uploaded=0)
            return begun.model_copy(update={"done": packed})
    local_root = datasets.local_root()
    plan, existing = plan_pack(source, config.data, local_root, config.data.pack_parts)
    if plan is None:
        assert existing is not None
        dataset_dir = local_root / existing.fingerprint
        uploaded = datasets.publish(dataset_dir, existing)  # packed here before, maybe never uploaded
        return begun.model_copy(update={"done": _packed(begun, root, dataset_dir, existing, True, uploaded)})
    start_pack(plan)
    return begun.model_copy(update={"plan": plan})


def pack_part_stage(data: DataConfig, plan: PackPlan, part: PackPart) -> PackedPart:
    """Pack one part (see `training.data.packing.PackPart`); small result, pieces on disk."""
    return pack_part(plan, part, data)


def pack_finish(config: RetrainConfig, begun: PackBegun, parts: list[PackedPart]) -> PackResult:
    """Assemble the shards from the parts' pieces (or pass on the reused dataset) and publish them."""
    if begun.done is not None:
        return begun.done.model_copy(update={"seconds": time.time() - begun.started_at})
    assert begun.plan is not None
    return _published(config, begun, assemble_shards(begun.plan, parts, config.data), len(parts))


def _published(config: RetrainConfig, begun: PackBegun, manifest: DatasetManifest, parts: int) -> PackResult:
    assert begun.plan is not None
    root = StorageRoot.from_config(config)
    dataset_dir = Path(begun.plan.final_dir)
    uploaded = DatasetStore(root).publish(dataset_dir, manifest)
    return _packed(begun, root, dataset_dir, manifest, reused=False, uploaded=uploaded, parts=parts)


def _packed(begun: PackBegun, root: StorageRoot, dataset_dir: Path, manifest: DatasetManifest, reused: bool,
            uploaded: int, parts: int | None = None) -> PackResult:
    return PackResult(
        source=begun.source, dataset_dir=str(dataset_dir), dataset_uri=root.display(f"datasets/{manifest.fingerprint}"),
        fingerprint=manifest.fingerprint, rows=manifest.rows, shards=len(manifest.shards), reused=reused,
        uploaded_bytes=uploaded, storage=begun.storage, bayes_auc=begun.bayes_auc, started_at=begun.started_at,
        seconds=time.time() - begun.started_at, parts=parts,
    )


def pack_stage(config: RetrainConfig) -> PackResult:
    """The whole pack stage in this process: begin, every part in turn, finish."""
    begun = pack_begin(config)
    if begun.plan is None:
        return pack_finish(config, begun, [])
    return _published(config, begun, pack_serially(begun.plan, config.data), len(begun.plan.parts))

