"""The decide stage: does this run have anything to learn? (`train.retrain_when`)

Between packing and preprocessing. The data new since the champion was trained is the
dataset's segments that the champion's statistics do not list. Two checks, both cheap:

- drift: each feature's PSI between the champion's training distribution (stored with its
  feature statistics) and the new segments' (from their statistics, taken at packing);
- degradation: the champion scored on every new row, against the test metric it was promoted on.

`drift` trains when a feature drifted past `train.drift_threshold` or the champion degraded by
more than `eval.min_delta`; `degraded` when it degraded. Otherwise the run keeps the champion
and reports why. A run always trains when it cannot judge: no usable champion, a champion of
another model or other columns, or statistics from before segment datasets.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

from training.config import TASK_METRICS, RetrainConfig, metric_name
from training.data.ingest.segment_stats import merge_stats
from training.data.ingest.segments import load_segment, read_stats
from training.data.manifest import DatasetManifest, SegmentRef, require_manifest, segments_dir
from training.data.prepare.drift import DriftReference, feature_drift
from training.data.prepare.features import FeatureStats
from training.errors import DataError
from training.pipeline.handoffs import PackResult, TrainingDecision
from training.copies import updated

if TYPE_CHECKING:  # torch: loaded when a champion is checked, not when the flow is imported
    from training.model.package_meta import PackageMeta
    from training.registry.champion import Champion

log = logging.getLogger(__name__)

__all__ = ["decide_stage"]


def _metric(config: RetrainConfig) -> str:
    return config.eval.metric or TASK_METRICS[config.data.task][0]


def decide_stage(config: RetrainConfig, packed: PackResult) -> TrainingDecision:
    t0 = time.perf_counter()
    mode = config.train.retrain_when
    if mode == "always":
        return TrainingDecision(train=True, reason="train.retrain_when is always", mode=mode)
    decision = _decide(config, packed)
    decision = updated(decision, {"seconds": time.perf_counter() - t0})
    log.info("%s: %s", "training" if decision.train else "keeping the champion", decision.reason)
    return decision


def _decide(config: RetrainConfig, packed: PackResult) -> TrainingDecision:
    from training.model.package_meta import PackageMeta
    from training.pipeline.stage_calls import champion_in_child

    mode, metric = config.train.retrain_when, _metric(config)
    base = TrainingDecision(train=True, reason="", mode=mode, threshold=config.train.drift_threshold, metric=metric)
    champion = champion_in_child(config)  # verified and loaded in the stage child: torch
    if champion is None or not champion.usable:
        return updated(base, {"reason": "no usable champion to keep"})
    meta = PackageMeta.read(champion.package)
    stats = meta.stats()
    base = updated(base, {"champion_sha256": champion.sha256})
    manifest = require_manifest(Path(packed.dataset_dir))
    why_not = _incomparable(config, meta, stats, manifest)
    if why_not is not None:
        return updated(base, {"reason": why_not})
    new = [ref for ref in manifest.segments if ref.key not in set(stats.segments)]
    if not new:
        return updated(base, {"train": False, "reason": "no data new since the champion was trained"})
    drift = _drift(stats, manifest, packed, new)
    drifted = sorted(f for f, v in drift.items() if v > config.train.drift_threshold)
    recorded, now = _champion_scores(config, champion, manifest, packed, [r.key for r in new])
    degraded = _degraded(config, recorded, now)
    base = updated(base, {
        "new_segments": len(new), "new_rows": sum(sum(r.rows.values()) for r in new), "drift": drift,
        "drifted": drifted, "champion_metric": recorded, "champion_metric_new": now})
    return updated(base, _verdict(config, mode, drifted, degraded, recorded, now))


def _incomparable(config: RetrainConfig, meta: PackageMeta, stats: FeatureStats,
                  manifest: DatasetManifest) -> str | None:
    """Why the champion cannot stand in for this run's model (None: it can)."""
    from training.model.compatibility import compatible, other_target

    if meta.architecture != config.model.model_dump(mode="json"):
        return "the champion's model config differs from model.*: this run trains its own"
    if not compatible(stats, manifest) or other_target(stats, manifest) is not None:
        return "the champion was trained on other columns or another label"
    if not stats.segments or not stats.drift:
        return "the champion's statistics predate segment datasets: there is nothing to compare the data with"
    return None


def _drift(stats: FeatureStats, manifest: DatasetManifest, packed: PackResult,
           new: list[SegmentRef]) -> dict[str, float]:
    regression = manifest.task == "regression"
    parts = []
    for ref in new:
        folder = segments_dir(Path(packed.dataset_dir)) / ref.key
        segment = load_segment(folder)
        if segment is None:
            raise DataError(f"segment {ref.key} is missing; run the same command again: the pack stage packs it again")
        parts.append(read_stats(folder, segment, len(manifest.categorical), regression))
    merged = merge_stats(parts)
    if merged.rows == 0:
        return {}
    reference = DriftReference.model_validate(stats.drift)
    return {k: round(v, 6) for k, v in feature_drift(reference, merged, manifest.numeric, manifest.categorical).items()}


def _champion_scores(config: RetrainConfig, champion: Champion, manifest: DatasetManifest, packed: PackResult,
                     keys: list[str]) -> tuple[float | None, float | None]:
    """(the champion's recorded test metric, its metric on every row of the new segments),
    scored in the stage child: the flow's process never imports torch."""
    from training.pipeline.stage_calls import champion_scores_in_child

    metric = _metric(config)
    recorded = (champion.pointer.metrics or {}).get(metric) if champion.pointer is not None else None
    scores = champion_scores_in_child(config, packed, str(champion.package), champion.meta_sha256, keys)
    now = scores.get(metric)
    return (float(recorded) if recorded is not None else None,
            float(now) if now is not None and math.isfinite(now) else None)


def champion_scores(config: RetrainConfig, packed: PackResult, package: Path, meta_sha256: str | None,
                    keys: list[str]) -> dict[str, float]:
    """The champion's metrics on every row of the segments `keys` (in the stage child)."""
    from training.model.evaluation import evaluate_package

    view = require_manifest(Path(packed.dataset_dir)).restricted_to(set(keys))
    return evaluate_package(package, Path(packed.dataset_dir), view, config.model.factory,
                            split=("train", "validation", "test"), expected_meta_sha256=meta_sha256)


def _degraded(config: RetrainConfig, recorded: float | None, now: float | None) -> bool | None:
    """Whether the champion scores worse on the new rows by more than eval.min_delta (None:
    cannot tell, e.g. a binary AUC over rows of one class)."""
    from training.model.task_metrics import is_better

    if recorded is None or now is None:
        return None
    return is_better(config.data.task, _metric(config), recorded, now, config.eval.min_delta)


def _verdict(config: RetrainConfig, mode: str, drifted: list[str], degraded: bool | None, recorded: float | None,
             now: float | None) -> dict[str, object]:
    name = metric_name(_metric(config))
    score = (f"the champion's {name} on the new rows is {now:.4f} against {recorded:.4f} when promoted"
             if now is not None and recorded is not None else f"the champion's {name} on the new rows cannot be "
             "computed")
    if degraded:
        return {"train": True, "reason": f"{score}: worse by more than eval.min_delta {config.eval.min_delta}"}
    if mode == "drift" and drifted:
        shown = ", ".join(drifted[:5]) + (f" and {len(drifted) - 5} more" if len(drifted) > 5 else "")
        return {"train": True, "reason": f"drift over train.drift_threshold {config.train.drift_threshold} in {shown}"}
    if degraded is None and mode == "degraded":
        return {"train": True, "reason": f"{score}: training to be safe"}
    drift = "no feature drifted past train.drift_threshold; " if mode == "drift" else ""
    return {"train": False, "reason": f"{drift}{score}, within eval.min_delta {config.eval.min_delta}"}
