"""The train stage: the training job of a config and dataset (its run key, a warm start from
the champion when asked and possible, `training.pipeline.warm_start`), trained in a child
process, on several nodes started through TorchX (`training.launch.group`), or found finished."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from training.config import RetrainConfig, fingerprint
from training.data.ingest.packing import forget_verification
from training.data.manifest import require_manifest
from training.data.prepare.features import (
    derived_rels,
    preprocess_key,
    verified_feature_stats,
)
from training.errors import DamagedShard, DataError
from training.launch.group import run_group
from training.launch.process import log_child_event, run_training_process
from training.pipeline.handoffs import PackResult, PrepResult
from training.pipeline.precision_pick import auto_precision
from training.pipeline.warm_start import start_warm, warm_start_plan
from training.protocol.events import ChildEvent, Validated
from training.protocol.job import TrainJob, train_fingerprint
from training.protocol.numerics import job_numerics
from training.protocol.results import ChampionCheck, TrainResult, WarmStart
from training.protocol.runs import RUN_FOLDERS, finished_result, run_rel
from training.registry.tracking import BackgroundTracker, flat_params, tracker_for
from training.storage.root import StorageRoot
from training.copies import updated

if TYPE_CHECKING:
    from training.registry.champion import Champion

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
        started = start_warm(config, warm, packed, manifest, root)
        config, stats_path = started.config, started.stats_path
        init_sha, new_segments, init_classes = warm.sha256, started.new_segments, started.init_classes
    elif manifest.text or manifest.image:  # preprocessing's token ids and pixels, on this machine
        for rel in derived_rels(str(Path(prep.stats_rel).parent), manifest):
            root.fetch(rel)
    numerics = job_numerics(config)
    tc = config.train
    if numerics == ("cuda", "bf16") and tc.precision == "auto" and tc.distributed.nnodes == 1:
        # auto on a GPU with native bf16: what is measured faster for this model (see
        # training.pipeline.precision_pick), decided once under the key the run has with auto.
        numerics = ("cuda", auto_precision(config, packed, prep,
                                           run_key_for(config, packed.fingerprint, init_sha, ("cuda", "auto"))))
    run_key = run_key_for(config, packed.fingerprint, init_sha, numerics)
    rate, gpus = config.cost.rate()
    rel = run_rel(run_key)
    for sub in RUN_FOLDERS:  # links out of the root are refused before anything is written there
        root.path(f"{rel}/{sub}")
    job = TrainJob(
        run_key=run_key, run_dir=str(root.path(rel)), run_rel=rel, numerics=list(numerics),
        dataset_dir=packed.dataset_dir, stats_path=str(stats_path), config=config,
        init_weights=warm.weights if warm else None, init_sha256=init_sha, new_segments=new_segments,
        init_classes=init_classes,
        rate_per_hour=rate, gpus=gpus,
        pre_train_seconds=packed.seconds + prep.seconds,
        champion_val_metric=champion_val_metric if config.budget.champion_gate else None,
    )
    if warm is None and verified_feature_stats(stats_path) is None:
        raise DataError(f"feature statistics {stats_path} no longer match their checksum since the preprocess stage "
                        "fitted them (another writer of the storage root changed them); run the same command again: "
                        "preprocessing fits them again")
    job.pin_inputs()  # what the child trains on is what was checked here
    warm_start = WarmStart(requested=config.train.init_from == "champion", used=warm is not None,
                           reason=warm_reason, champion_sha256=init_sha)
    return job, warm_start


def train_stage(
    config: RetrainConfig,
    packed: PackResult,
    prep: PrepResult,
    champion: Champion | None,
    on_event: Callable[[ChildEvent], None] = log_child_event,
    champion_val_metric: float | None = None,
) -> TrainResult:
    """Train the run in a child process (or find it finished). `champion` is `check_champion`'s
    answer, verified before training (a damaged champion is reported in seconds, not after a
    full run) and once per flow run, so that every attempt of the train task warm-starts from the
    same one and resumes the same run. `champion_val_metric` is the champion gate's bar,
    measured by `champion_validation_auc` before training."""
    from training.model.task_metrics import higher_is_better
    t0 = time.perf_counter()
    root = StorageRoot.from_config(config)
    job, warm_start = build_train_job(config, packed, prep, champion, champion_val_metric)
    # A finished run needs no child process (and no 3 s of torch start-up).
    try:
        result = finished_result(job) or _train_tracked(config, job, on_event)
    except DamagedShard:
        forget_verification(Path(packed.dataset_dir))  # the next pack checks every shard, finds it, repacks
        raise
    return updated(result, {
        "run_dir": job.run_dir,
        "run_uri": root.display(job.run_rel),
        "seconds_this_attempt": time.perf_counter() - t0,
        "warm_start": warm_start,
        "champion_check": None if champion is None else ChampionCheck(sha256=champion.sha256, problem=champion.problem),
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
