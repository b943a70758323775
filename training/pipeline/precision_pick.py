"""`train.precision: auto` on a GPU: the precision measured faster for this model at its batch,
not bf16 by rule. The pick is part of the run key (a run's numerics are what it computes), so it
is made once, before the key, and kept: `plan/precision/<key>.json`, keyed by the run as it would
be keyed with `auto` and the GPU's name, read back by every retry and resume of the run.

The measurement runs in the stage child (it needs torch; the flow's process never imports it):
a few interleaved rounds of forward and backward steps in fp32 and in bf16 on a batch of the
train split (`training.trainer.precision.time_precisions`), and bf16 only where it wins beyond
the noise (`training.protocol.numerics.pick_precision`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from pydantic import ValidationError

from training.config import RetrainConfig
from training.pipeline.handoffs import PackResult, PrepResult
from training.protocol.numerics import PrecisionPick, gpu_name, pick_precision
from training.storage.files import write_json_atomic
from training.storage.root import CACHE, StorageRoot

__all__ = ["auto_precision", "measure_precision"]

log = logging.getLogger(__name__)


def auto_precision(config: RetrainConfig, packed: PackResult, prep: PrepResult, key: str) -> str:
    """The precision `auto` means for this run on this GPU: stored under `key` (the run keyed
    with `auto`), or measured in the stage child now and stored."""
    from training.pipeline.stage_calls import precision_in_child

    root = StorageRoot.from_config(config)
    gpu = gpu_name()
    rel = f"plan/precision/{key}.json"
    found = root.fetch(rel)
    if found is not None:
        try:
            pick = PrecisionPick.model_validate_json(found.read_bytes())
            if pick.gpu == gpu:
                return pick.precision
            log.info("%s was measured on %s, not this %s: measuring again", root.display(rel), pick.gpu, gpu)
        except (OSError, ValidationError) as err:
            log.warning("%s is not a precision pick (%s): measuring again", root.display(rel), str(err).splitlines()[0])
    pick = precision_in_child(config, packed, prep)
    log.info("train.precision auto on %s: %s (a step took %.2f ms in fp32, %.2f ms in bf16)", pick.gpu, pick.precision,
             1e3 * sorted(pick.fp32_seconds)[len(pick.fp32_seconds) // 2],
             1e3 * sorted(pick.bf16_seconds)[len(pick.bf16_seconds) // 2])
    write_json_atomic(root.path(rel), pick.model_dump(mode="json"))
    root.publish(rel, CACHE)
    return pick.precision


def measure_precision(config: RetrainConfig, packed: PackResult, prep: PrepResult) -> PrecisionPick:
    """In the stage child: fp32 against bf16, timed on this model and a micro-batch of the train
    split on the training device."""
    import torch

    from training.data.load.loader import ShardBatches
    from training.data.manifest import require_manifest
    from training.data.prepare.features import DERIVED_DIR, FeatureStats
    from training.model.network import ModelSchema
    from training.model.objectives import Task
    from training.model.spec import build_model
    from training.trainer.precision import resolve_device, time_precisions

    stats = FeatureStats.from_json(Path(prep.stats_path).read_text())
    manifest = require_manifest(Path(packed.dataset_dir))
    tc = config.train
    batches = ShardBatches(Path(packed.dataset_dir), manifest, "train", max(1, tc.batch_size // tc.world_size),
                           stats.transformer(Path(prep.stats_path).parent / DERIVED_DIR), seed=tc.seed)
    device = resolve_device(tc.device)
    torch.manual_seed(tc.seed)
    model = build_model(config.model, ModelSchema.of(stats)).to(device)
    times = time_precisions(model, Task.of(stats), batches.batch(0, 0), device)
    batches.release()
    return pick_precision(times, gpu_name() if device.type == "cuda" else device.type)
