"""The train stage: the training job of a config and dataset (its run key, a warm start from
the champion when asked and possible), trained in a child process, on several nodes started
through TorchX (`training.launch.group`), or found finished."""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from training.config import RetrainConfig, fingerprint
from training.data.features import (
    DERIVED_DIR,
    DERIVED_INDEX,
    FeatureStats,
    derived_rels,
    grown_for_warm_start,
    preprocess_key,
    write_derived_arrays,
)
from training.data.manifest import DatasetManifest, require_manifest
from training.data.packing import forget_verification
from training.errors import DamagedShard, DataError
from training.model.package_meta import PackageMeta
from training.pipeline.handoffs import PackResult, PrepResult
from training.pipeline.step_budget import for_warm_start
from training.pipeline.tracking import BackgroundTracker, flat_params, tracker_for
from training.storage.files import write_json_atomic
from training.storage.root import StorageRoot
from training.launch.events import ChildEvent, Validated
from training.launch.job import TrainJob, train_fingerprint
from training.launch.numerics import job_numerics
from training.launch.group import run_group
from training.launch.process import log_child_event, run_training_process
from training.launch.results import TrainResult, WarmStart
from training.launch.runs import RUN_FOLDERS, finished_result, run_rel

if TYPE_CHECKING:
    from training.pipeline.champion import Champion

log = logging.getLogger(__name__)


def run_key_for(config: RetrainConfig, dataset_fingerprint: str, init_sha256: str | None = None,
                numerics: tuple[str, str] | None = None) -> str:
    """What a run computes, as a key: its dataset, preprocessing, model and training settings,
    and the numerics its training processes use (`job_numerics`, unless given)."""
    numerics = numerics or job_numerics(config)
    preprocessing = preprocess_key(dataset_fingerprint, config.preprocess, bool(config.data.text),
                                   config.data.task == "regression", bool(config.data.image))
    parts = ["run", dataset_fingerprint, preprocessing, train_fingerprint(config, *numerics)]
    if init_sha256 is not None:
        parts.append(f"warm:{init_sha256}")  # a warm start computes something else: its own run
    return fingerprint(*parts)


@dataclass(frozen=True)
class WarmStartPlan:
    """The champion's weights (and the sha256 they must have) and its feature statistics."""

    weights: str
    sha256: str
    stats: dict[str, Any]


def warm_start_plan(config: RetrainConfig, champion: Champion | None,
                    manifest: DatasetManifest | None = None) -> tuple[WarmStartPlan | None, str]:
    """(champion weights + stats, reason) when `train.init_from: champion` can be honoured."""
    from training.model.compatibility import compatible, other_target
    if config.train.init_from != "champion":
        return None, "train.init_from is none"
    if champion is None:
        return None, "no champion yet: fresh start"
    if not champion.usable:
        return None, f"the champion is unusable ({champion.problem}): fresh start"
    package = champion.package
    meta = PackageMeta.read(package)
    if meta.architecture != config.model.model_dump(mode="json"):
        return None, "the champion's model config differs from model.*: fresh start"
    stats = meta.stats()
    if stats.numeric != config.data.numeric or stats.categorical != config.data.categorical or (
            manifest is not None and not compatible(stats, manifest)):
        return None, "the champion's feature columns differ from this run's data.* columns: fresh start"
    other = other_target(stats, manifest) if manifest is not None else None
    added = _added_classes(config, stats, manifest) if other is not None else []
    if other is not None and not added:
        return None, f"the champion predicts something else ({other}): fresh start"
    grown = f", its output layer grown by the new classes {added}" if added else ""
    return (
        WarmStartPlan(weights=str(package / "model.pt"), sha256=champion.sha256, stats=meta.feature_stats),
        f"warm start from champion {champion.sha256[:12]} with its feature statistics, its vocabularies grown "
        f"by this dataset's new categories{grown}",
    )


def _added_classes(config: RetrainConfig, stats: FeatureStats, manifest: DatasetManifest | None) -> list[Any]:
    """The classes this dataset adds to a multiclass champion's, when it only adds some (none
    dropped, same task and label): the built-in model's output layer grows by them, as its
    embeddings grow by new categories. Empty when the champion cannot be grown into this model."""
    from training.model.compatibility import other_target
    if (manifest is None or config.model.factory is not None or manifest.task != "multiclass"
            or other_target(stats, manifest, classes_may_differ=True) is not None):
        return []
    dataset = set(manifest.classes)
    if not set(stats.classes) < dataset:
        return []
    known = set(stats.classes)
    return [c for c in manifest.classes if c not in known]


def build_train_job(config: RetrainConfig, packed: PackResult, prep: PrepResult, champion: Champion | None,
                    champion_val_metric: float | None = None) -> tuple[TrainJob, WarmStart]:
    """The training job of this config and data, with the warm-start decision; `champion` is
    `check_champion`'s answer, checked once by the caller.

    Deterministic in its inputs, so every node of a multi-node run builds the same job."""
    root = StorageRoot.from_config(config)
    stats_path = root.fetch(prep.stats_rel) or Path(prep.stats_path)
    if not stats_path.exists():
        # Gone since the preprocess stage ran (someone cleaned the root between retries). The
        # preprocess stage is not cached by Prefect, so rerunning the flow refits them.
        raise DataError(f"feature statistics {root.display(prep.stats_rel)} are gone since the preprocess stage "
                        "ran; rerun the flow (preprocessing refits them)")
    manifest = require_manifest(Path(packed.dataset_dir))
    warm, warm_reason = warm_start_plan(config, champion, manifest)
    init_sha, new_segments, init_classes = None, None, None
    if warm is not None:
        # Embedding rows and input scaling must mean what they meant for the champion: the
        # warm-started model keeps the champion's preprocessing, its vocabularies grown by this
        # dataset's new categories (the built-in model; a user's model keeps them as they are).
        init_sha = warm.sha256
        stats = FeatureStats(**warm.stats)
        init_classes = list(stats.classes) if stats.classes != manifest.classes else None
        seen = set(stats.segments)
        new_segments = [s.key for s in manifest.segments if s.key not in seen] if seen else None
        config = for_warm_start(config, warm_steps(config, manifest, stats))
        if config.model.factory is None:
            stats = grown_for_warm_start(stats, Path(packed.dataset_dir), manifest, config.preprocess)
        # Per dataset: the vocabularies, token ids and pixels depend on it.
        stats_path = root.path(f"preprocess/champion-{init_sha[:16]}-{packed.fingerprint[:16]}/feature_stats.json")
        if not stats_path.exists():
            write_json_atomic(stats_path, json.loads(stats.to_json()))
        _derive_for(Path(packed.dataset_dir), manifest, stats, stats_path.parent)
    elif manifest.text or manifest.image:  # preprocessing's token ids and pixels, on this machine
        for rel in derived_rels(str(Path(prep.stats_rel).parent), manifest):
            root.fetch(rel)
    run_key = run_key_for(config, packed.fingerprint, init_sha)
    rate, gpus = config.cost.rate()
    rel = run_rel(run_key)
    for sub in RUN_FOLDERS:  # links out of the root are refused before anything is written there
        root.path(f"{rel}/{sub}")
    job = TrainJob(
        run_key=run_key, run_dir=str(root.path(rel)), run_rel=rel, numerics=list(job_numerics(config)),
        dataset_dir=packed.dataset_dir, stats_path=str(stats_path), config=config,
        init_weights=warm.weights if warm else None, init_sha256=init_sha, new_segments=new_segments,
        init_classes=init_classes,
        rate_per_hour=rate, gpus=gpus,
        pre_train_seconds=packed.seconds + prep.seconds,
        champion_val_metric=champion_val_metric if config.budget.champion_gate else None,
    )
    warm_start = WarmStart(requested=config.train.init_from == "champion", used=warm is not None,
                           reason=warm_reason, champion_sha256=init_sha)
    return job, warm_start


def warm_steps(config: RetrainConfig, manifest: DatasetManifest, champion: FeatureStats) -> int:
    """A warm start's optimizer steps: train.warm_steps, or scaled to the share of the train
    split that is new since the champion was trained (see its description). A champion whose
    statistics list no segments (fitted before segment datasets) counts as having seen nothing."""
    t = config.train.for_train_rows(manifest.rows["train"])
    if t.warm_steps is not None:
        return t.warm_steps
    seen = set(champion.segments)
    new = sum(s.rows["train"] for s in manifest.segments if s.key not in seen) if manifest.segments else 0
    share = new / max(1, manifest.rows["train"]) if seen else 1.0
    return max(min(t.validate_every, t.max_steps), min(t.max_steps, math.ceil(3 * share * t.max_steps)))


def _derive_for(dataset_dir: Path, manifest: DatasetManifest, stats: FeatureStats, stats_dir: Path) -> None:
    """Token ids and pixels of this dataset under the champion's tokenizer and image size, for
    a warm start (training reads them stored, never tokenizes)."""
    if stats.derives and not (stats_dir / DERIVED_DIR / DERIVED_INDEX).exists():
        write_derived_arrays(dataset_dir, manifest, stats, stats_dir / DERIVED_DIR)


def train_stage(
    config: RetrainConfig,
    packed: PackResult,
    prep: PrepResult,
    on_event: Callable[[ChildEvent], None] = log_child_event,
    champion_val_metric: float | None = None,
) -> TrainResult:
    """Train the run in a child process (or find it finished); `champion_val_metric` is the
    champion gate's bar, measured by `champion_validation_auc` before training."""
    from training.model.task_metrics import higher_is_better
    from training.pipeline.champion import check_champion
    t0 = time.perf_counter()
    root = StorageRoot.from_config(config)
    # Verified before training: a damaged champion is reported in seconds, not after a full run.
    champion = check_champion(root, config.model.factory)
    job, warm_start = build_train_job(config, packed, prep, champion, champion_val_metric)
    # A finished run needs no child process (and no 3 s of torch start-up).
    try:
        result = finished_result(job) or _train_tracked(config, job, on_event)
    except DamagedShard:
        forget_verification(Path(packed.dataset_dir))  # the next pack checks every shard, finds it, repacks
        raise
    return result.model_copy(update={
        "run_dir": job.run_dir,
        "run_uri": root.display(job.run_rel),
        "seconds_this_attempt": time.perf_counter() - t0,
        "warm_start": warm_start,
        "champion_check": None if champion is None else {"sha256": champion.sha256, "problem": champion.problem},
        "steps_to_target": result.steps_to(config.eval.target_value(),
                                           higher_is_better(config.data.task, result.metric)),
    })


def _train_tracked(config: RetrainConfig, job: TrainJob, on_event: Callable[[ChildEvent], None]) -> TrainResult:
    """The training process, its validations also sent to MLflow when tracking is on."""
    launch = run_training_process if config.train.distributed.nnodes == 1 else run_group
    tracker = tracker_for(config, job.run_key, Path(job.run_dir))
    if tracker is None:
        return launch(job, on_event)
    background = BackgroundTracker(tracker, flat_params(config), "train_loss")

    def tracked(event: ChildEvent) -> None:
        if isinstance(event, Validated):
            background.submit(event.validation.logged_metrics(), event.step)
        on_event(event)

    try:
        return launch(job, tracked)
    finally:
        background.close(timeout=config.tracking.timeout_seconds)
