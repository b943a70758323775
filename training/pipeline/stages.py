"""The four pipeline stages as plain functions of small values (paths, fingerprints, metrics).

Each Prefect task in `tasks/` calls exactly one of these, so the whole pipeline also runs and
is tested without Prefect. Storage layout under `storage.root`:

    demo/                         the synthetic demo dataset (only when data.source is empty)
    datasets/<fingerprint>/       shards + manifest.json
    preprocess/<key>/             feature_stats.json
    runs/<run_key>/               checkpoints/, model/, result.json, evaluation.json, report.json
    models/<sha256>/              promoted model packages
    models/champion               pointer (JSON) to the champion package
    prefect/                      Prefect task results and cache records

With `storage.root: s3://bucket/prefix` the same layout lives under the prefix, and the stages
work on a local copy of the parts they need (`training.storage.root`).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from pydantic import BaseModel, ConfigDict, ValidationError

from training.config import DataConfig, PreprocessConfig, RetrainConfig, StorageConfig, fingerprint
from training.cost.bill import compute_cost, naive_counterfactual, restarting_counterfactual, storage_cost
from training.data.demo import DEMOS, ensure_demo_dataset
from training.data.dataset_store import DatasetStore
from training.data.features import (DERIVED_DIR, DERIVED_INDEX, PREPROCESS_VERSION, derived_rels, fit_feature_stats,
                                     preprocess_key, verified_feature_stats, write_derived_arrays)
from training.data.sources import dataset_fingerprint, source_files
from training.data.packing import (
    DatasetManifest,
    PackPart,
    PackPlan,
    assemble_shards,
    forget_verification,
    pack_part,
    plan_pack,
    require_manifest,
    split_writers,
    start_pack,
)
from training.errors import ConfigError, DamagedShard, DataError, RetrainError, StorageError
from training.data.features import FeatureStats
from training.pipeline.tracking import BackgroundTracker, MlflowTracker, flat_params, register_model, tracker_for
from training.trainer.launch import log_child_event, run_training_process
from training.trainer.job import TrainJob, train_fingerprint
from training.pipeline.report_markdown import render_curves, render_markdown
from training.trainer.results import Evaluation, LaunchPhases, PackResult, PrepResult, Promotion, TrainResult, WarmStart
from training.trainer.runs import RUN_FOLDERS, finished_result, run_rel
from training.storage.files import read_json, write_json_atomic
from training.storage.root import CACHE, MODEL, RUN, StorageRoot
from training.pipeline.unchanged import record_unchanged
from training.cost.utilization import utilization_summary

if TYPE_CHECKING:
    from training.pipeline.champion import Champion

# The torch-backed modules (champion, evaluate, export, package, precision, tasks) are imported
# inside the functions that use them: `retrain run` starts the flow without loading torch, and a
# run's pack and preprocess stages never load it.

log = logging.getLogger(__name__)

__all__ = ["PackBegun", "build_train_job", "champion_validation_metric", "join_training", "pack_stage", "pack_begin", "pack_part_stage", "pack_finish", "preprocess_stage", "train_stage", "evaluate_stage", "report_stage", "run_key_for"]


class PackBegun(BaseModel):
    """The pack stage's first step: the reused dataset (`done`), or the plan and its parts,
    which `pack_part_stage` runs, serially here or fanned out by the flow."""

    model_config = ConfigDict(frozen=True)

    source: str
    storage: dict[str, Any]
    bayes_auc: float | None
    started_at: float
    done: PackResult | None = None
    plan: dict[str, Any] | None = None  # a PackPlan as JSON: a Prefect map input
    parts: list[dict[str, Any]] = []


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
    return begun.model_copy(update={"plan": asdict(plan), "parts": [asdict(p) for p in plan.parts]})


def _plan_of(plan: dict[str, Any]) -> PackPlan:
    fields = {k: plan[k] for k in ("source", "fingerprint", "sources", "work_dir", "final_dir", "classes",
                                   "vector_dims")}
    return PackPlan(**fields, parts=[_part_of(p) for p in plan["parts"]])


def _part_of(part: dict[str, Any]) -> PackPart:
    return PackPart(**{**part, "row_groups": tuple(part["row_groups"])})  # JSON made the tuple a list


def pack_part_stage(data: dict[str, Any], plan: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    """Pack one part (see `training.data.packing.PackPart`); small result, pieces on disk."""
    return pack_part(_plan_of(plan), _part_of(part), DataConfig.model_validate(data))


def pack_finish(config: RetrainConfig, begun: PackBegun, parts: list[dict[str, Any]],
                writers: dict[str, Any] | None = None) -> PackResult:
    """Assemble the shards from the parts (or finish the `writers` the parts fed directly, or
    pass on the reused dataset) and publish them."""
    if begun.done is not None:
        return begun.done.model_copy(update={"seconds": time.time() - begun.started_at})
    assert begun.plan is not None
    plan = _plan_of(begun.plan)
    root = StorageRoot.from_config(config)
    try:
        manifest = assemble_shards(plan, parts, config.data, writers)
    except BaseException:
        shutil.rmtree(plan.work_dir, ignore_errors=True)
        raise
    dataset_dir = Path(plan.final_dir)
    uploaded = DatasetStore(root).publish(dataset_dir, manifest)
    return _packed(begun, root, dataset_dir, manifest, reused=False, uploaded=uploaded, parts=len(parts))


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
    # In one process the parts go in order straight into the shard writers (no pieces on
    # disk); the bytes are the same as when the flow fans the parts out.
    plan = _plan_of(begun.plan)
    try:
        writers = split_writers(plan, config.data)
        parts = [pack_part(plan, part, config.data, writers) for part in plan.parts]
    except BaseException:
        shutil.rmtree(plan.work_dir, ignore_errors=True)
        raise
    return pack_finish(config, begun, parts, writers)


def preprocess_stage(
    dataset_dir: str,
    preprocess: dict[str, Any],
    storage_root: str,
    storage: dict[str, Any] | None = None,
    tags: dict[str, str] | None = None,
) -> PrepResult:
    t0 = time.perf_counter()
    config = PreprocessConfig.model_validate(preprocess)
    manifest = require_manifest(Path(dataset_dir))
    root = StorageRoot(StorageConfig.model_validate(storage or {"root": storage_root}), tags)
    rel_dir = f"preprocess/{preprocess_key(manifest.fingerprint, config, bool(manifest.text))}"
    rel = f"{rel_dir}/feature_stats.json"
    check_rel = f"{rel}.sha256"
    # Fitted before, on any machine, and still matching its checksum: reuse it.
    root.fetch(rel)
    root.fetch(check_rel)
    existing = verified_feature_stats(root.path(rel))
    derived = derived_rels(rel_dir, manifest) if manifest.text or manifest.image else []
    if existing is not None and derived and root.fetch(derived[-1]) is not None:
        for derived_rel in derived[:-1]:  # token ids and pixels: fetched whole, checked as they load
            root.fetch(derived_rel)
    reused = existing is not None and (not derived or root.path(derived[-1]).exists())
    if existing is not None and reused:
        stats_path, stats = root.path(rel), existing  # verified once, not again inside the fit
    else:
        stats_path, stats = fit_feature_stats(Path(dataset_dir), manifest, config, root.path("preprocess"))
    if not reused:
        # The derived arrays' index, then the statistics, then their checksum: each marks what
        # precedes it complete.
        root.publish_all([*derived, rel, check_rel], CACHE)
    return PrepResult(stats_path=str(stats_path), stats_rel=rel, reused=reused, key=stats.key,
                      code_version=PREPROCESS_VERSION, cardinalities=stats.cardinalities,
                      seconds=time.perf_counter() - t0)


def run_key_for(config: RetrainConfig, dataset_fingerprint: str, init_sha256: str | None = None) -> str:
    from training.trainer.precision import resolved_numerics
    numerics = resolved_numerics(config.train.device, config.train.precision)
    parts = ["run", dataset_fingerprint, preprocess_key(dataset_fingerprint, config.preprocess, bool(config.data.text)),
             train_fingerprint(config, *numerics)]
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
    from training.model.evaluation import compatible, other_target
    if config.train.init_from != "champion":
        return None, "train.init_from is none"
    if champion is None:
        return None, "no champion yet: fresh start"
    if not champion.usable:
        return None, f"the champion is unusable ({champion.problem}): fresh start"
    pointer, package = champion.pointer, champion.package
    meta = read_json(package / "model.json")
    if meta["model_config"] != config.model.model_dump(mode="json"):
        return None, "the champion's model config differs from model.*: fresh start"
    stats = meta["feature_stats"]
    if stats["numeric"] != config.data.numeric or stats["categorical"] != config.data.categorical or (
            manifest is not None and not compatible(FeatureStats(**stats), manifest)):
        return None, "the champion's feature columns differ from this run's data.* columns: fresh start"
    other = other_target(FeatureStats(**stats), manifest) if manifest is not None else None
    if other is not None:
        return None, f"the champion predicts something else ({other}): fresh start"
    return (
        WarmStartPlan(weights=str(package / "model.pt"), sha256=pointer["sha256"], stats=stats),
        f"warm start from champion {pointer['sha256'][:12]} with its feature statistics",
    )


def champion_validation_metric(config: RetrainConfig, packed: PackResult) -> float | None:
    """The champion's eval.metric on this run's validation split, for the champion gate (None
    when there is no usable champion that reads these columns and predicts this label).
    Evaluation's work, run before training by the flow."""
    from training.pipeline.champion import check_champion
    from training.model.evaluation import compatible, evaluate_package, other_target
    from training.model.package import package_stats
    from training.model.objectives import metric_for
    champion = check_champion(StorageRoot.from_config(config), config.model.factory)
    if champion is None or not champion.usable:
        return None
    dataset_dir = Path(packed.dataset_dir)
    manifest = require_manifest(dataset_dir)
    stats = package_stats(champion.package)
    if not compatible(stats, manifest) or other_target(stats, manifest) is not None:
        return None
    metric = metric_for(config.data.task, config.eval.metric)
    return evaluate_package(champion.package, dataset_dir, manifest, config.model.factory, split="validation")[metric]


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
    init_sha = None
    if warm is not None:
        # Embedding rows and input scaling must mean what they meant for the champion, so the
        # warm-started model keeps the champion's preprocessing; unseen categories share index 0.
        init_sha = warm.sha256
        # The champion's token ids and pixels of *this* dataset live beside its statistics, so
        # with text or image columns the folder is per dataset too: another dataset's arrays
        # (same shard names) must never be read for this one.
        per_dataset = f"-{packed.fingerprint[:16]}" if manifest.text or manifest.image else ""
        stats_path = root.path(f"preprocess/champion-{init_sha[:16]}{per_dataset}/feature_stats.json")
        if not stats_path.exists():
            write_json_atomic(stats_path, warm.stats)
        _derive_for(Path(packed.dataset_dir), manifest, FeatureStats(**warm.stats), stats_path.parent)
    elif manifest.text or manifest.image:  # preprocessing's token ids and pixels, on this machine
        for rel in derived_rels(str(Path(prep.stats_rel).parent), manifest):
            root.fetch(rel)
    run_key = run_key_for(config, packed.fingerprint, init_sha)
    rate, gpus = config.cost.rate()
    rel = run_rel(run_key)
    for sub in RUN_FOLDERS:  # links out of the root are refused before anything is written there
        root.path(f"{rel}/{sub}")
    job = TrainJob(
        run_key=run_key, run_dir=str(root.path(rel)), run_rel=rel,
        dataset_dir=packed.dataset_dir, stats_path=str(stats_path), config=config,
        init_weights=warm.weights if warm else None, init_sha256=init_sha, rate_per_hour=rate, gpus=gpus,
        pre_train_seconds=packed.seconds + prep.seconds,
        champion_val_metric=champion_val_metric if config.budget.champion_gate else None,
    )
    warm_start = WarmStart(requested=config.train.init_from == "champion", used=warm is not None,
                           reason=warm_reason, champion_sha256=init_sha)
    return job, warm_start


def _derive_for(dataset_dir: Path, manifest: DatasetManifest, stats: FeatureStats, stats_dir: Path) -> None:
    """Token ids and pixels of this dataset under the champion's tokenizer and image size, for
    a warm start (training reads them stored, never tokenizes)."""
    if stats.derives and not (stats_dir / DERIVED_DIR / DERIVED_INDEX).exists():
        write_derived_arrays(dataset_dir, manifest, stats, stats_dir / DERIVED_DIR)


def train_stage(
    config: RetrainConfig,
    packed: PackResult,
    prep: PrepResult,
    on_event: Callable[[dict[str, Any]], None] = log_child_event,
    champion_val_metric: float | None = None,
) -> TrainResult:
    """Train the run in a child process (or find it finished); `champion_val_metric` is the
    champion gate's bar, measured by `champion_validation_auc` before training."""
    from training.pipeline.champion import check_champion
    from training.model.objectives import higher_is_better
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


def _train_tracked(config: RetrainConfig, job: TrainJob, on_event: Callable[[dict[str, Any]], None]) -> TrainResult:
    """The training process, its validations also sent to MLflow when tracking is on."""
    tracker = tracker_for(config, job.run_key, Path(job.run_dir))
    if tracker is None:
        return run_training_process(job, on_event)
    background = BackgroundTracker(tracker, flat_params(config), "train_loss")

    def tracked(event: dict[str, Any]) -> None:
        if event["event"] == "validation":
            background.submit({k: v for k, v in event.items() if k == "train_loss" or k.startswith("val_")},
                              int(event["step"]))
        on_event(event)

    try:
        return run_training_process(job, tracked)
    finally:
        background.close(timeout=config.tracking.timeout_seconds)


def join_training(config: RetrainConfig, node_rank: int) -> int:
    """Run this node's ranks of a multi-node job (`retrain join`): the same data, statistics and
    job as node 0 builds (all content-addressed, from the shared root), under torchrun against
    the same rendezvous. Returns torchrun's exit code."""
    from training.pipeline.champion import check_champion
    import subprocess

    from training.trainer.launch import child_env, worker_command

    if config.train.nnodes < 2:
        raise ConfigError("retrain join is for multi-node runs: set train.nnodes >= 2 and train.rdzv_endpoint")
    if not 1 <= node_rank < config.train.nnodes:
        raise ConfigError(f"--node-rank must be 1..{config.train.nnodes - 1} (node 0 is the flow's own node)")
    packed = pack_stage(config)
    prep = preprocess_stage(packed.dataset_dir, config.preprocess.model_dump(mode="json"), config.storage.root,
                            config.storage.model_dump(mode="json"), config.cost.tags)
    job, _ = build_train_job(config, packed, prep, check_champion(StorageRoot.from_config(config), config.model.factory))
    run_dir = Path(job.run_dir)
    node_dir = run_dir / f"node-{os.getpid()}"
    node_dir.mkdir(parents=True, exist_ok=True)
    job_path = node_dir / "job.json"
    job.save(job_path)
    command = worker_command(job, job_path, node_dir / "error.json", node_rank=node_rank)
    return subprocess.run(command, env=child_env()).returncode


def evaluate_stage(config: RetrainConfig, packed: PackResult, trained: TrainResult) -> Evaluation:
    """The challenger's test metrics and the champion/challenger decision, promoted atomically."""
    from training.pipeline.champion import check_champion
    from training.model.evaluation import decide_promotion, evaluate_package
    from training.model.objectives import metric_for, reaches
    t0 = time.perf_counter()
    root = StorageRoot.from_config(config)
    run_dir = Path(trained.run_dir)
    dataset_dir = Path(packed.dataset_dir)
    manifest = require_manifest(dataset_dir)
    challenger_sha = trained.model.sha256
    done = _finished_promotion(root, run_dir, trained.run_key, challenger_sha, config)
    if done is not None:
        _register(config, trained, done.promotion.promoted)  # the interrupted run may not have got this far
        return done
    metrics = evaluate_package(run_dir / "model", dataset_dir, manifest, config.model.factory,
                               expected_meta_sha256=trained.model.meta_sha256)
    task, metric = manifest.task, metric_for(manifest.task, config.eval.metric)
    for _attempt in range(_PROMOTION_ATTEMPTS):
        champion = check_champion(root, config.model.factory)
        champion_metrics, champion_note, problem = _champion_metrics(champion, dataset_dir, manifest, config)
        elsewhere = _champion_target(champion, manifest)
        if elsewhere is not None:
            # Another task's champion is not worse or better, only different: it stays.
            promoted, reason = False, f"promotion skipped: the champion {elsewhere}"
            break
        promoted, reason = decide_promotion(
            challenger_sha, metrics, champion.sha256 if champion else None, champion_metrics, config.eval, problem,
            task, metric,
        )
        if not promoted or _promote(root, run_dir, trained, packed, metrics, champion, config.model.factory):
            break
        # Compare-and-swap lost: another machine promoted after our comparison. Compare again
        # with the new champion rather than overwrite it.
        log.warning("the champion changed while this run was evaluated; comparing with the new one")
    else:
        raise StorageError(f"the champion at {root.display('models/champion')} changed {_PROMOTION_ATTEMPTS} times "
                           "while this run was evaluated; run the same command again")
    target = config.eval.target_value()
    evaluation = Evaluation(
        tags=dict(config.cost.tags), metrics=metrics, task=task, metric=metric, target=target,
        target_auc=target if metric == "auc" else None,
        target_met=None if target is None else reaches(task, metric, metrics[metric], target),
        promotion=Promotion(promoted=promoted, reason=reason, challenger_sha256=challenger_sha,
                            champion_sha256=champion.sha256 if champion else None,
                            champion_metrics=champion_metrics, champion_note=champion_note,
                            champion_problem=champion.problem if champion else None),
        seconds=time.perf_counter() - t0,
    )
    # "Already the champion" (a rerun that trained nothing) holds the champion alias as surely as a promotion.
    _register(config, trained, promoted or (champion is not None and champion.usable
                                            and champion.sha256 == challenger_sha))
    write_json_atomic(run_dir / "evaluation.json", evaluation.to_json())
    root.publish(f"{run_rel(trained.run_key)}/evaluation.json", RUN, trained.run_key)
    return evaluation


def _register(config: RetrainConfig, trained: TrainResult, is_champion: bool) -> None:
    """The model in the MLflow registry, its aliases following the champion pointer (tracking on).
    A run that finished before tracking saw it (a rerun that trains nothing, tracking turned on
    since) gets its MLflow run here, whole: its config and every validation."""
    run_dir = Path(trained.run_dir)
    tracker = tracker_for(config, trained.run_key, run_dir)
    if tracker is None:
        return
    if tracker.run_id(flat_params(config)) is not None:
        logged = tracker.logged_steps("train_loss")
        for entry in trained.history:
            if int(entry["step"]) not in logged:
                tracker.log_metrics({k: v for k, v in entry.items() if k == "train_loss" or k.startswith("val_")},
                                    int(entry["step"]), "validation metrics")
    register_model(tracker, run_dir / "model", trained.model.sha256, is_champion)


_PROMOTION_ATTEMPTS = 3


def _finished_promotion(root: StorageRoot, run_dir: Path, run_key: str, challenger_sha: str,
                        config: RetrainConfig) -> Evaluation | None:
    """This run's evaluation when it already promoted its model and that model is still the
    champion: a rerun after an interrupt (say, during the report) reports that promotion,
    instead of finding its own model in place and saying "already the champion". A run whose
    report was written is finished: rerunning it reports that its model is already champion."""
    from training.pipeline.champion import check_champion
    if (run_dir / "report.json").exists() or root.fetch(f"{run_rel(run_key)}/report.json") is not None:
        return None
    try:
        recorded = Evaluation.model_validate(read_json(run_dir / "evaluation.json"))
    except (StorageError, ValidationError):
        return None  # absent or damaged: evaluate again
    if not recorded.promotion.promoted or recorded.promotion.challenger_sha256 != challenger_sha:
        return None
    champion = check_champion(root, config.model.factory)
    return recorded if champion is not None and champion.usable and champion.sha256 == challenger_sha else None


def _promote(root: StorageRoot, run_dir: Path, trained: TrainResult, packed: PackResult,
             metrics: dict[str, Any], champion: Champion | None, trusted_factory: str | None) -> bool:
    """The package (with its portable export) first, the pointer last (a reader that finds the
    pointer finds the model); on S3 the pointer is swapped only if it is still the version
    compared against."""
    from training.model.evaluation import promote
    from training.model.export import EXPORT_DIR, exported_files
    sha = trained.model.sha256
    package = run_dir / "model"
    export_note = _export(package, trusted_factory)
    promote(root.path("models"), package, sha,
            {"run_key": trained.run_key, "metrics": metrics, "dataset": packed.fingerprint,
             "export": export_note or f"models/{sha}/{EXPORT_DIR}/model.pt2"},
            uri=root.display(f"models/{sha}/model.pt"))
    files = ["model.pt", "model.json", *exported_files(root.path(f"models/{sha}"))]
    root.publish_all([f"models/{sha}/{name}" for name in files], MODEL, trained.run_key)
    return root.publish_if_unchanged("models/champion", MODEL, trained.run_key, champion.etag if champion else None)


def _export(package: Path, trusted_factory: str | None) -> str | None:
    """The portable export beside the package; why there is none, when there is none. A model
    torch.export cannot trace (a custom factory's Python control flow) is still promoted."""
    from training.model.export import export_portable
    from training.model.package import load_package
    model, stats, _ = load_package(package, trusted_factory)
    try:
        export_portable(package, model, stats)
    except Exception as err:  # noqa: BLE001 - torch.export's errors have no common base; promotion goes on
        reason = f"torch.export could not trace the model: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
        log.warning("no portable export for %s: %s", package, reason)
        return reason
    return None


def _champion_metrics(
    champion: Champion | None, dataset_dir: Path, manifest: DatasetManifest, config: RetrainConfig
) -> tuple[dict[str, Any] | None, str | None, str | None]:
    """(the champion's test metrics to compare with, how they were obtained, why it is unusable)."""
    from training.model.evaluation import compatible, evaluate_package
    from training.model.package import package_stats
    if champion is None:
        return None, None, None
    if champion.usable and compatible(package_stats(champion.package), manifest):
        return (evaluate_package(champion.package, dataset_dir, manifest, config.model.factory,
                                 expected_meta_sha256=champion.pointer.get("meta_sha256")),
                "re-evaluated on this run's test split", None)
    recorded = champion.pointer.get("metrics")
    if champion.usable or champion.recorded_metrics_only:
        why = ("feature columns differ from this dataset" if champion.usable
               else "its model factory is not this run's, so it is not loaded")
        return recorded, f"{why}: compared on its recorded test metrics", None
    return None, f"unusable: {champion.problem}", champion.problem


def _champion_target(champion: Champion | None, manifest: DatasetManifest) -> str | None:
    """Why the champion predicts something else than this run (None: the same thing, or no
    champion whose statistics can be read)."""
    from training.model.evaluation import other_target
    from training.model.package import package_stats
    if champion is None or not (champion.usable or champion.recorded_metrics_only):
        return None
    try:
        other = other_target(package_stats(champion.package), manifest)
    except (RetrainError, TypeError, KeyError):
        return None  # unreadable statistics: the usual champion checks report it
    return None if other is None else f"{champion.sha256[:12]} is kept: {other}"


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def cost_report(config: RetrainConfig, packed: PackResult, prep: PrepResult, trained: TrainResult,
                evaluation: Evaluation) -> dict[str, Any]:
    """The bill of this run from measured seconds and bytes, and the naive counterfactual."""
    rate, gpus = config.cost.rate()
    seconds = trained.seconds
    train_billed = trained.billed_seconds - seconds.get("pre_train", 0.0)
    stages = {"pack": packed.seconds, "preprocess": prep.seconds, "train": train_billed,
              "evaluate": evaluation.seconds}
    compute = compute_cost(stages, rate, gpus)
    run_dir = Path(trained.run_dir)
    storage = storage_cost(
        {"shards": _dir_bytes(Path(packed.dataset_dir)), "checkpoints": _dir_bytes(run_dir / "checkpoints"),
         "models": _dir_bytes(run_dir / "model")},
        config.cost.storage_class, config.cost.storage_per_gb_month, config.cost.retention_days,
    )
    per_step = (seconds["train"] + seconds["eval"] + seconds["checkpoint"]) / max(1, trained.steps)
    on_demand = config.cost.prices[config.cost.instance_type].on_demand_per_hour
    one_start = seconds.get("startup", 0.0) / (1 + trained.preemptions)  # the naive run starts once too
    naive = naive_counterfactual(
        other_stage_seconds=packed.seconds + prep.seconds + evaluation.seconds + one_start,
        train_seconds_per_step=per_step,
        naive_steps=trained.max_steps,
        fp32_slowdown=trained.fp32_slowdown,
        on_demand_per_hour=on_demand,
        gpus=gpus,
    )
    # A preemption hit this run at about the step it resumed from plus the steps it lost then.
    resumed = trained.resumed_from_steps
    lost_each = trained.steps_lost / max(1, len(resumed))
    restarting = restarting_counterfactual(
        naive=naive, steps_reached_at_preemptions=[int(s + lost_each) for s in resumed],
        train_seconds_per_step=per_step, restart_seconds=one_start, rate_per_hour=rate, gpus=gpus,
    )
    # Like with like: the naive jobs keep the same dataset and model, but write no checkpoints.
    naive_storage = storage["total_usd"] - storage["checkpoints"]["usd"]
    for figure in (naive, restarting):
        figure["storage_usd"] = naive_storage
        figure["total_usd"] = figure["usd"] + naive_storage
    total = compute["usd"] + storage["total_usd"]
    naive_total = naive["total_usd"]
    return {
        "instance_type": config.cost.instance_type,
        "market": config.cost.market,
        "rate_per_hour": rate,
        "gpus": gpus,
        "compute": compute,
        "gpu_hours": compute["gpu_hours"],
        "storage": storage,
        "total_usd": total,
        "naive": naive,
        "savings_usd": naive_total - total,
        "savings_fraction": (naive_total - total) / naive_total if naive_total else 0.0,
        "naive_restarting": restarting,
        "savings_vs_restarting_usd": restarting["total_usd"] - total,
        "tags": dict(config.cost.tags),
    }


def report_stage(
    config: RetrainConfig, packed: PackResult, prep: PrepResult, trained: TrainResult,
    evaluation: Evaluation, stage_states: dict[str, str], flow_run_id: str | None = None,
    launch: LaunchPhases | None = None, stage_ends: dict[str, float] | None = None,
) -> dict[str, str]:
    """Write report.json, curves.png and report.md into the run folder; return their paths.
    `flow_run_id` is the Prefect flow run that wrote it (None outside Prefect); `launch` what
    `retrain run` spent before the flow (None for a deployed run); `stage_ends` when the flow
    began ("flow") and each stage ended, in epoch seconds."""
    started = time.time()
    run_dir = Path(trained.run_dir)
    root = StorageRoot.from_config(config)
    report = _report(config, packed, prep, trained, evaluation, stage_states, flow_run_id)
    curves = render_curves(trained.history, run_dir / "curves.png", evaluation.metric)
    tracker = tracker_for(config, trained.run_key, run_dir)
    if tracker is not None:
        report["tracking"] = _track_report(tracker, config, trained, report, flow_run_id)
    (run_dir / "report.md").write_text(render_markdown(report, curves, embed=False))
    if tracker is not None:
        files = [run_dir / "report.md", *([curves] if curves else [])]
        tracker.do("report.md and curves.png", lambda c: [c.log_artifact(tracker.notes.run_id, str(f)) for f in files])
        tracker.save()
    report["files"] = {"report_md": str(run_dir / "report.md"), "curves_png": str(curves) if curves else None}
    report["storage"] = {**packed.storage, "run_uri": root.display(run_rel(trained.run_key))}
    report["phases"] = _phases(launch, stage_ends or {}, trained, time.time() - started)
    # One report per flow run (a rerun of the same run key is another flow run: it must not
    # overwrite the record of the first), and report.json the latest of them.
    rel = run_rel(trained.run_key)
    own = f"reports/{flow_run_id or time.strftime('local-%Y%m%dT%H%M%S', time.gmtime(started))}.json"
    write_json_atomic(run_dir / own, report)
    path = run_dir / "report.json"
    write_json_atomic(path, report)
    root.publish_all([f"{rel}/report.md"] + ([f"{rel}/curves.png"] if curves else [])
                     + [f"{rel}/{own}", f"{rel}/report.json"], RUN, trained.run_key)
    _record_if_repeatable(config, root, packed, trained, evaluation, report, f"{rel}/report.json")
    return {"report": str(path), "markdown": str(run_dir / "report.md"), "curves": str(curves) if curves else ""}


def _phases(launch: LaunchPhases | None, ends: dict[str, float], trained: TrainResult,
            report_seconds: float) -> dict[str, float | None]:
    """Where a run's wall time went, in seconds, in order: the CLI's share and Prefect's flow
    run creation (None for a deployed run), each stage as the flow saw it, and within training
    the child's start-up to its first step. What follows the report (Prefect finishing the flow
    run, a temporary server's stop, the exit) the CLI prints."""
    phases: dict[str, float | None] = {"config": None, "imports": None, "server_start": None, "flow_start": None}
    if launch is not None:
        phases.update(config=launch.config_seconds, imports=launch.imports_seconds,
                      server_start=launch.server_seconds,
                      flow_start=ends["flow"] - launch.flow_called_at if "flow" in ends else None)
    previous = ends.get("flow")
    for stage in ("pack", "preprocess", "train", "evaluate"):
        end = ends.get(stage)
        phases[stage] = end - previous if end is not None and previous is not None else None
        previous = end
    phases["child_start"] = None if trained.already_complete else trained.first_step_latency_seconds
    phases["report"] = report_seconds
    return phases


def _record_if_repeatable(config: RetrainConfig, root: StorageRoot, packed: PackResult, trained: TrainResult,
                          evaluation: Evaluation, report: dict[str, Any], report_rel: str) -> None:
    """Let `retrain run` skip a rerun that would change nothing (`training.pipeline.unchanged`), unless
    a rerun would do something: warm-start from the model this run just promoted, judge a
    champion that was unusable (perhaps repaired since), or record what MLflow missed."""
    promotion = evaluation.promotion
    if promotion.promoted and config.train.init_from == "champion":
        return
    if promotion.champion_problem is not None or (report.get("tracking") or {}).get("problems"):
        return
    champion_after = promotion.challenger_sha256 if promotion.promoted else promotion.champion_sha256
    record_unchanged(config, root, trained.run_key, packed.fingerprint, packed.source, champion_after, report_rel)


def _track_report(tracker: MlflowTracker, config: RetrainConfig, trained: TrainResult, report: dict[str, Any],
                  flow_run_id: str | None) -> dict[str, Any]:
    """Test metrics, cost and tags into the run key's MLflow run; what was (not) recorded."""
    run_id = tracker.run_id(flat_params(config))
    if run_id is not None:
        cost = report["cost"]
        metrics = {f"test_{k}": float(v) for k, v in report["metrics"].items() if isinstance(v, (int, float))}
        metrics.update(cost_usd=float(cost["total_usd"]), gpu_hours=float(cost["gpu_hours"]))
        tracker.log_metrics(metrics, trained.steps, "test metrics and cost")
        tags = {**{f"cost.{k}": v for k, v in config.cost.tags.items()}, "retrain.status": str(report["status"]),
                **({"prefect.flow_run_id": flow_run_id} if flow_run_id else {})}
        tracker.do("tags", lambda c: [c.set_tag(run_id, k, v) for k, v in tags.items()])
        tracker.do("the run's end", lambda c: c.set_terminated(run_id, "FINISHED"))
    tracker.save()
    return tracker.notes.model_dump()


def _report(config: RetrainConfig, packed: PackResult, prep: PrepResult, trained: TrainResult,
            evaluation: Evaluation, stage_states: dict[str, str], flow_run_id: str | None) -> dict[str, Any]:
    """report.json's content (its keys are a contract: extend them only)."""
    durations = {"pack": packed.seconds, "preprocess": prep.seconds, "train": trained.seconds_this_attempt,
                 "evaluate": evaluation.seconds}
    preemption = {
        "preemptions": trained.preemptions, "resumed_from_steps": trained.resumed_from_steps,
        "steps_lost": trained.steps_lost, "seconds_lost": trained.seconds["lost"],
        "checkpoint_seconds": trained.seconds["checkpoint"], "checkpoints_saved": trained.checkpoints_saved,
        "checkpoint_interval": trained.checkpoint_interval,
        "restart_to_first_step_seconds": trained.restart_to_first_step_seconds,
    }
    stages = {
        "pack": {"state": stage_states.get("pack"), "reused": packed.reused, "dataset": packed.fingerprint,
                 "rows": packed.rows, "shards": packed.shards, "dir": packed.dataset_dir},
        "preprocess": {"state": stage_states.get("preprocess"), "key": prep.key, "stats": prep.stats_path},
        "train": {"state": stage_states.get("train"), "already_complete": trained.already_complete,
                  "best_step": trained.best_step, "best_val_auc": trained.best_val_auc,
                  "best_val_metric": trained.best_val_metric,
                  "precision": trained.precision, "device": trained.device, "seconds": trained.seconds,
                  "first_step_latency_seconds": trained.first_step_latency_seconds, "history": trained.history,
                  "threads": trained.threads.model_dump() if trained.threads else None,
                  "num_workers": trained.num_workers},
        "evaluate": {"state": stage_states.get("evaluate")},
    }
    return {
        "run_key": trained.run_key, "status": trained.status, "stop_reason": trained.stop_reason,
        "steps": trained.steps, "task": evaluation.task, "metric": evaluation.metric,
        "metrics": {k: v for k, v in evaluation.metrics.items() if k != "rows"},
        "model": trained.model.to_json(), "resumed_from_steps": trained.resumed_from_steps,
        "preemptions": trained.preemptions, "steps_lost": trained.steps_lost, "durations": durations,
        "preemption": preemption, "cost": cost_report(config, packed, prep, trained, evaluation),
        "utilization": utilization_summary(trained.seconds, trained.samples_seen, trained.accelerator, trained.device),
        "tags": dict(config.cost.tags), "profile": trained.profile, "stages": stages,
        "target": evaluation.target, "target_auc": evaluation.target_auc, "target_met": evaluation.target_met,
        "promotion": evaluation.promotion.to_json(),
        "warm_start": trained.warm_start.to_json() if trained.warm_start else None,
        "steps_to_target": trained.steps_to_target, "bayes_auc": packed.bayes_auc,
        "prefect_flow_run_id": flow_run_id,
        "pipeline_started_at": packed.started_at,  # epoch seconds when the first stage began
    }
