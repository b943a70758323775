"""The evaluate stage: the challenger's exact test metrics and the champion/challenger decision,
promoted atomically (compare-and-swap on S3); and the champion's validation metric for the
champion gate, which the flow runs before training."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from training.config import RetrainConfig
from training.data.manifest import DatasetManifest, require_manifest
from training.errors import RetrainError, StorageError
from training.pipeline.handoffs import Evaluation, PackResult, Promotion
from training.protocol.results import TrainResult
from training.protocol.runs import run_rel
from training.registry.tracking import flat_params, register_model, tracker_for
from training.storage.files import read_json, write_json_atomic
from training.storage.root import MODEL, RUN, StorageRoot
from training.metrics import Metrics

if TYPE_CHECKING:
    from training.model.evaluation import PackageScores
    from training.model.paired import PairedDifference
    from training.registry.champion import Champion

log = logging.getLogger(__name__)


def champion_validation_metric(config: RetrainConfig, packed: PackResult) -> float | None:
    """The champion's eval.metric on this run's validation split, for the champion gate (None
    when there is no usable champion that reads these columns and predicts this label).
    Evaluation's work, run before training by the flow."""
    from training.model.compatibility import compatible, other_target
    from training.model.evaluation import evaluate_package
    from training.model.package import package_stats
    from training.model.task_metrics import metric_for
    from training.registry.champion import champion_of
    champion = champion_of(config)
    if champion is None or not champion.usable:
        return None
    dataset_dir = Path(packed.dataset_dir)
    manifest = require_manifest(dataset_dir)
    stats = package_stats(champion.package)
    if not compatible(stats, manifest) or other_target(stats, manifest) is not None:
        return None
    metric = metric_for(config.data.task, config.eval.metric)
    return evaluate_package(champion.package, dataset_dir, manifest, config.model.factory, split="validation")[metric]


def evaluate_stage(config: RetrainConfig, packed: PackResult, trained: TrainResult) -> Evaluation:
    """The challenger's test metrics and the champion/challenger decision, promoted atomically."""
    from training.model.evaluation import score_package
    from training.model.task_metrics import metric_for, reaches
    from training.registry.champion import check_champion, decide_promotion
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
    scores = score_package(run_dir / "model", dataset_dir, manifest, config.model.factory,
                           expected_meta_sha256=trained.model.meta_sha256)
    metrics = scores.metrics
    task, metric = manifest.task, metric_for(manifest.task, config.eval.metric)
    difference = None
    for _attempt in range(_PROMOTION_ATTEMPTS):
        champion = check_champion(root, config.model.factory)
        champion_metrics, champion_note, problem, theirs = _champion_metrics(champion, dataset_dir, manifest, config)
        elsewhere = _champion_target(champion, manifest)
        if elsewhere is not None:
            # Another task's champion is not worse or better, only different: it stays.
            promoted, reason = False, f"promotion skipped: the champion {elsewhere}"
            break
        compared, difference = _paired(scores, theirs, task, metric, config)
        promoted, reason = decide_promotion(
            challenger_sha, compared, champion.sha256 if champion else None, champion_metrics, config.eval, problem,
            task, metric, difference,
        )
        if compared is not metrics:
            reason += f" (on the {compared['rows']} test rows of the classes both models know)"
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
                            champion_problem=champion.problem if champion else None,
                            difference=difference),
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
        for validation in trained.history:
            if validation.step not in logged:
                tracker.log_metrics(validation.logged_metrics(), validation.step, "validation metrics")
    register_model(tracker, run_dir / "model", trained.model.sha256, is_champion)


_PROMOTION_ATTEMPTS = 3


def _finished_promotion(root: StorageRoot, run_dir: Path, run_key: str, challenger_sha: str,
                        config: RetrainConfig) -> Evaluation | None:
    """This run's evaluation when it already promoted its model and that model is still the
    champion: a rerun after an interrupt (say, during the report) reports that promotion,
    instead of finding its own model in place and saying "already the champion". A run whose
    report was written is finished: rerunning it reports that its model is already champion."""
    from training.registry.champion import check_champion
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
             metrics: Metrics, champion: Champion | None, trusted_factory: str | None) -> bool:
    """The package (with its portable export) first, the pointer last (a reader that finds the
    pointer finds the model); on S3 the pointer is swapped only if it is still the version
    compared against."""
    from training.model.export import EXPORT_DIR, exported_files
    from training.model.model_ref import ChampionPointer
    from training.registry.champion import promote
    sha = trained.model.sha256
    package = run_dir / "model"
    export_note = _export(package, trusted_factory)
    promote(root.path("models"), package,
            ChampionPointer(sha256=sha, run_key=trained.run_key, metrics=metrics, dataset=packed.fingerprint,
                            export=export_note or f"models/{sha}/{EXPORT_DIR}/model.pt2",
                            uri=root.display(f"models/{sha}/model.pt")))
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
) -> tuple[Metrics | None, str | None, str | None, PackageScores | None]:
    """(the champion's test metrics to compare with, how they were obtained, why it is unusable,
    its scores row by row when it was re-evaluated here)."""
    from training.model.compatibility import compatible
    from training.model.evaluation import score_package
    from training.model.package import package_stats
    if champion is None:
        return None, None, None, None
    if champion.usable and compatible(stats := package_stats(champion.package), manifest):
        new = [c for c in manifest.classes if c not in set(stats.classes)] if manifest.task == "multiclass" else []
        how = "re-evaluated on this run's test split" + (
            f", on the rows of the classes it knows (new since: {', '.join(map(repr, new))})" if new else "")
        theirs = score_package(champion.package, dataset_dir, manifest, config.model.factory,
                               expected_meta_sha256=champion.meta_sha256)
        return theirs.metrics, how, None, theirs
    recorded = champion.pointer.metrics if champion.pointer is not None else None
    if champion.usable or champion.recorded_metrics_only:
        why = ("feature columns differ from this dataset" if champion.usable
               else "its model factory is not this run's, so it is not loaded")
        return recorded, f"{why}: compared on its recorded test metrics", None, None
    return None, f"unusable: {champion.problem}", champion.problem, None


def _paired(ours: PackageScores, theirs: PackageScores | None, task: str, metric: str, config: RetrainConfig
            ) -> tuple[Metrics, PairedDifference | None]:
    """(the challenger's metrics on the rows the champion was scored on, the improvement with
    its confidence interval), both on the same rows: all of them, or, where the champion's
    classes are not this dataset's, the rows of the classes it knows."""
    from training.model.paired import paired_difference
    from training.model.task_metrics import METRICS

    if theirs is None:
        return ours.metrics, None
    compared = ours.metrics
    y, pred = ours.y, ours.pred
    if theirs.rows.size != ours.rows.size:
        y, pred = ours.y[theirs.rows], ours.pred[theirs.rows]
        compared = {**{name: m.fn(y, pred) for name, m in METRICS[task].items()}, "rows": int(y.size)}
    difference = paired_difference(task, metric, y, pred, theirs.pred, config.eval.confidence,
                                   y_champion=theirs.y)
    return compared, difference


def compare_on_validation(config: RetrainConfig, packed: PackResult, challenger: Path, base: Path
                          ) -> PairedDifference:
    """`challenger`'s improvement over `base` (two model packages) on the validation split, row
    by row, with its interval: a tuning study's pick against the config it was given."""
    from training.model.evaluation import score_package
    from training.model.task_metrics import metric_for

    dataset_dir = Path(packed.dataset_dir)
    manifest = require_manifest(dataset_dir)
    ours = score_package(challenger, dataset_dir, manifest, config.model.factory, split="validation")
    theirs = score_package(base, dataset_dir, manifest, config.model.factory, split="validation")
    _, difference = _paired(ours, theirs, manifest.task, metric_for(manifest.task, config.eval.metric), config)
    assert difference is not None  # both were scored
    return difference


def _champion_target(champion: Champion | None, manifest: DatasetManifest) -> str | None:
    """Why the champion predicts something else than this run (None: the same thing, or no
    champion whose statistics can be read)."""
    from training.model.compatibility import other_target
    from training.model.package import package_stats
    if champion is None or not (champion.usable or champion.recorded_metrics_only):
        return None
    try:
        other = other_target(package_stats(champion.package), manifest, classes_may_differ=True)
    except (RetrainError, TypeError, KeyError):
        return None  # unreadable statistics: the usual champion checks report it
    return None if other is None else f"{champion.sha256[:12]} is kept: {other}"

