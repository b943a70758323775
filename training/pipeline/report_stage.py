"""The report stage: what a run cost, where its time went and what it decided, written as
`report.json` (one per flow run, and the latest), `report.md` and `curves.png`, and recorded in
MLflow when tracking is on."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

from training.config import RetrainConfig
from training.cost.bill import CostReport, compute_cost, naive_counterfactual, restarting_counterfactual, storage_cost
from training.cost.utilization import utilization_summary
from training.pipeline.handoffs import (
    Evaluation,
    LaunchPhases,
    PackResult,
    PrepResult,
    StageEnds,
    StageStates,
    TrainingDecision,
)
from training.pipeline.reports.markdown import render_curves, render_markdown
from training.pipeline.reports.run_report import (
    Durations,
    EvaluateSummary,
    KeptReport,
    PackSummary,
    Phases,
    PreemptionSummary,
    PreprocessSummary,
    ReportFiles,
    RunReport,
    StageSummaries,
    TrainSummary,
)
from training.pipeline.unchanged import record_unchanged
from training.protocol.results import TrainResult
from training.protocol.runs import run_rel
from training.registry.step_times import StepTime, StepTimeBook, step_time_of_run
from training.registry.tracking import MlflowTracker, TrackingNotes, flat_params, tracker_for
from training.storage.files import write_json_atomic
from training.storage.root import RUN, StorageRoot
from training.copies import updated

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


class ReportPaths(BaseModel):
    """Where the report stage wrote: report.json, report.md, and curves.png (None: no history)."""

    model_config = ConfigDict(frozen=True)

    report: str
    markdown: str
    curves: str | None


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def cost_report(config: RetrainConfig, packed: PackResult, prep: PrepResult, trained: TrainResult,
                evaluation: Evaluation) -> CostReport:
    """The bill of this run from measured seconds and bytes, and the naive counterfactuals."""
    rate, gpus = config.cost.rate()
    seconds = trained.seconds
    train_billed = trained.billed_seconds - seconds.pre_train
    stages = {"pack": packed.seconds, "preprocess": prep.seconds, "train": train_billed,
              "evaluate": evaluation.seconds}
    compute = compute_cost(stages, rate, gpus)
    run_dir = Path(trained.run_dir)
    storage = storage_cost(
        {"shards": packed.dataset_bytes, "checkpoints": _dir_bytes(run_dir / "checkpoints"),
         "models": _dir_bytes(run_dir / "model")},
        config.cost.storage_class, config.cost.storage_per_gb_month, config.cost.retention_days,
    )
    per_step = (seconds.train + seconds.eval + seconds.checkpoint) / max(1, trained.steps)
    on_demand = config.cost.prices[config.cost.instance_type].on_demand_per_hour
    one_start = seconds.startup / (1 + trained.preemptions)  # the naive run starts once too
    naive = naive_counterfactual(
        other_stage_seconds=packed.seconds + prep.seconds + evaluation.seconds + one_start,
        train_seconds_per_step=per_step, naive_steps=trained.max_steps, fp32_slowdown=trained.fp32_slowdown,
        on_demand_per_hour=on_demand, gpus=gpus,
    )
    # A preemption hit this run at about the step it resumed from plus the steps it lost then.
    resumed = trained.resumed_from_steps
    lost_each = trained.steps_lost / max(1, len(resumed))
    restarting = restarting_counterfactual(
        naive=naive, steps_reached_at_preemptions=[int(s + lost_each) for s in resumed],
        train_seconds_per_step=per_step, restart_seconds=one_start, rate_per_hour=rate, gpus=gpus,
    )
    # Like with like: the naive jobs keep the same dataset and model, but write no checkpoints.
    naive_storage = storage.total_usd - storage.checkpoints.usd
    naive, restarting = naive.with_storage(naive_storage), restarting.with_storage(naive_storage)
    total = compute.usd + storage.total_usd
    return CostReport(
        instance_type=config.cost.instance_type, market=config.cost.market, rate_per_hour=rate, gpus=gpus,
        compute=compute, gpu_hours=compute.gpu_hours, storage=storage, total_usd=total, naive=naive,
        savings_usd=naive.total_usd - total,
        savings_fraction=(naive.total_usd - total) / naive.total_usd if naive.total_usd else 0.0,
        naive_restarting=restarting, savings_vs_restarting_usd=restarting.total_usd - total,
        tags=dict(config.cost.tags), declared_on=_declared_on(config, trained.device),
    )


def _declared_on(config: RetrainConfig, device: str) -> str | None:
    """What the run ran on, when the priced instance type is not that kind of machine."""
    has_gpu = config.cost.prices[config.cost.instance_type].gpu is not None or \
        config.cost.prices[config.cost.instance_type].gpus > 0
    if has_gpu == (device == "cuda"):
        return None
    return "a CUDA GPU" if device == "cuda" else "the CPU"


def _step_time(config: RetrainConfig, root: StorageRoot, trained: TrainResult) -> StepTime | None:
    """Seconds per step measured by this run against the prediction for its instance type;
    stored for the next `retrain plan` when the run ran on that instance type's device."""
    if trained.step_count is None or trained.already_complete or trained.steps == 0:
        return None
    done = trained.steps + trained.steps_lost
    record = step_time_of_run(config, trained.step_count, trained.device, trained.seconds.train / done,
                              trained.run_key, trained.world_size)
    if record.recorded:
        StepTimeBook.load(root).add(root, record)
    return record


def report_stage(
    config: RetrainConfig, packed: PackResult, prep: PrepResult, trained: TrainResult,
    evaluation: Evaluation, stage_states: StageStates, flow_run_id: str | None = None,
    launch: LaunchPhases | None = None, stage_ends: StageEnds | None = None,
    decision: TrainingDecision | None = None,
) -> ReportPaths:
    """Write report.json, curves.png and report.md into the run folder; return their paths.
    `flow_run_id` is the Prefect flow run that wrote it (None outside Prefect); `launch` what
    `retrain run` spent before the flow (None for a deployed run); `stage_ends` when the flow
    began ("flow") and each stage ended, in epoch seconds."""
    started = time.time()
    run_dir = Path(trained.run_dir)
    root = StorageRoot.from_config(config)
    report = _report(config, packed, prep, trained, evaluation, stage_states, flow_run_id)
    report.decision = decision if decision is not None and decision.mode != "always" else None
    report.step_time = _step_time(config, root, trained)
    curves = render_curves(trained.history, run_dir / "curves.png", evaluation.metric)
    tracker = tracker_for(config, trained.run_key, run_dir)
    if tracker is not None:
        report.tracking = _track_report(tracker, config, trained, report, flow_run_id)
    (run_dir / "report.md").write_text(render_markdown(report, curves, embed=False))
    if tracker is not None:
        files = [run_dir / "report.md", *([curves] if curves else [])]
        tracker.do("report.md and curves.png", lambda c: [c.log_artifact(tracker.notes.run_id, str(f)) for f in files])
        tracker.save()
    report.files = ReportFiles(report_md=str(run_dir / "report.md"), curves_png=str(curves) if curves else None)
    report.storage = updated(packed.storage, {"run_uri": root.display(run_rel(trained.run_key))})
    report.phases = _phases(launch, stage_ends, trained, time.time() - started)
    # One report per flow run (a rerun of the same run key is another flow run: it must not
    # overwrite the record of the first), and report.json the latest of them.
    rel = run_rel(trained.run_key)
    own = f"reports/{flow_run_id or time.strftime('local-%Y%m%dT%H%M%S', time.gmtime(started))}.json"
    write_json_atomic(run_dir / own, report.to_json())
    path = run_dir / "report.json"
    write_json_atomic(path, report.to_json())
    root.publish_all([f"{rel}/report.md"] + ([f"{rel}/curves.png"] if curves else [])
                     + [f"{rel}/{own}", f"{rel}/report.json"], RUN, trained.run_key)
    _record_if_repeatable(config, root, packed, trained, evaluation, report, f"{rel}/report.json")
    return ReportPaths(report=str(path), markdown=str(run_dir / "report.md"), curves=str(curves) if curves else None)


def _phases(launch: LaunchPhases | None, ends: StageEnds | None, trained: TrainResult,
            report_seconds: float) -> Phases:
    """Where a run's wall time went, in seconds, in order: the CLI's share and Prefect's flow
    run creation (None for a deployed run), each stage as the flow saw it, and within training
    the child's start-up to its first step. What follows the report (Prefect finishing the flow
    run, a temporary server's stop, the exit) the CLI prints."""
    phases: dict[str, float | None] = {}
    if launch is not None:
        phases.update(config=launch.config_seconds, imports=launch.imports_seconds,
                      server_start=launch.server_seconds,
                      flow_start=ends.flow - launch.flow_called_at if ends is not None else None)
    if ends is not None:
        phases.update(ends.durations())
    return Phases(**phases, child_start=None if trained.already_complete else trained.first_step_latency_seconds,
                  report=report_seconds)


def _record_if_repeatable(config: RetrainConfig, root: StorageRoot, packed: PackResult, trained: TrainResult,
                          evaluation: Evaluation, report: RunReport, report_rel: str) -> None:
    """Let `retrain run` skip a rerun that would change nothing (`training.pipeline.unchanged`), unless
    a rerun would do something: warm-start from the model this run just promoted, judge a
    champion that was unusable (perhaps repaired since), or record what MLflow missed."""
    promotion = evaluation.promotion
    if promotion.promoted and config.train.init_from == "champion":
        return
    if promotion.champion_problem is not None or (report.tracking is not None and report.tracking.problems):
        return
    champion_after = promotion.challenger_sha256 if promotion.promoted else promotion.champion_sha256
    record_unchanged(config, root, trained.run_key, packed.fingerprint, packed.source, champion_after, report_rel)


def _track_report(tracker: MlflowTracker, config: RetrainConfig, trained: TrainResult, report: RunReport,
                  flow_run_id: str | None) -> TrackingNotes:
    """Test metrics, cost and tags into the run key's MLflow run; what was (not) recorded."""
    run_id = tracker.run_id(flat_params(config))
    if run_id is not None:
        metrics = {f"test_{k}": float(v) for k, v in report.metrics.items()}
        metrics.update(cost_usd=report.cost.total_usd, gpu_hours=report.cost.gpu_hours)
        tracker.log_metrics(metrics, trained.steps, "test metrics and cost")
        tags = {**{f"cost.{k}": v for k, v in config.cost.tags.items()}, "retrain.status": report.status,
                **({"prefect.flow_run_id": flow_run_id} if flow_run_id else {})}
        tracker.do("tags", lambda c: [c.set_tag(run_id, k, v) for k, v in tags.items()])
        tracker.do("the run's end", lambda c: c.set_terminated(run_id, "FINISHED"))
    tracker.save()
    return tracker.notes


def _report(config: RetrainConfig, packed: PackResult, prep: PrepResult, trained: TrainResult,
            evaluation: Evaluation, stage_states: StageStates, flow_run_id: str | None) -> RunReport:
    """report.json's content, less what the report stage adds as it writes it."""
    seconds = trained.seconds
    stages = StageSummaries(
        pack=PackSummary(state=stage_states.pack, reused=packed.reused, dataset=packed.fingerprint,
                         rows=packed.rows, shards=packed.shards, dir=packed.dataset_dir, segments=packed.segments,
                         segments_packed=packed.segments_packed, source_bytes_read=packed.source_bytes_read,
                         packed_bytes=packed.packed_bytes, uploaded_bytes=packed.uploaded_bytes,
                         dropped_null_labels=packed.dropped_null_labels),
        preprocess=PreprocessSummary(state=stage_states.preprocess, key=prep.key, stats=prep.stats_path,
                                      target_transform=prep.target_transform),
        train=TrainSummary(state=stage_states.train, already_complete=trained.already_complete,
                           eval_every=trained.eval_every, patience=trained.patience, best_step=trained.best_step,
                           best_val_auc=trained.best_val_auc,
                           best_val_metric=trained.best_val_metric, precision=trained.precision,
                           device=trained.device, seconds=seconds,
                           first_step_latency_seconds=trained.first_step_latency_seconds, history=trained.history,
                           threads=trained.threads, num_workers=trained.num_workers),
        evaluate=EvaluateSummary(state=stage_states.evaluate),
    )
    return RunReport(
        run_key=trained.run_key, status=trained.status, stop_reason=trained.stop_reason, steps=trained.steps,
        task=evaluation.task, metric=evaluation.metric,
        metrics={k: v for k, v in evaluation.metrics.items() if k != "rows"}, model=trained.model,
        resumed_from_steps=trained.resumed_from_steps, preemptions=trained.preemptions,
        steps_lost=trained.steps_lost,
        durations=Durations(pack=packed.seconds, preprocess=prep.seconds, train=trained.seconds_this_attempt,
                            evaluate=evaluation.seconds),
        preemption=PreemptionSummary(
            preemptions=trained.preemptions, resumed_from_steps=trained.resumed_from_steps,
            steps_lost=trained.steps_lost, seconds_lost=seconds.lost, checkpoint_seconds=seconds.checkpoint,
            checkpoints_saved=trained.checkpoints_saved, checkpoint_interval=trained.checkpoint_interval,
            restart_to_first_step_seconds=trained.restart_to_first_step_seconds),
        cost=cost_report(config, packed, prep, trained, evaluation),
        utilization=utilization_summary(seconds.train, seconds.data_wait, seconds.compute, seconds.checkpoint,
                                        seconds.eval, trained.samples_seen, trained.accelerator, trained.device,
                                        trained.precision, trained.fp32_slowdown),
        tags=dict(config.cost.tags), profile=trained.profile, stages=stages, target=evaluation.target,
        target_auc=evaluation.target_auc, target_met=evaluation.target_met, promotion=evaluation.promotion,
        warm_start=trained.warm_start, steps_to_target=trained.steps_to_target, bayes_auc=packed.bayes_auc,
        prefect_flow_run_id=flow_run_id, pipeline_started_at=packed.started_at,
    )


def kept_report_stage(config: RetrainConfig, packed: PackResult, decision: TrainingDecision,
                      flow_run_id: str | None = None) -> str:
    """Write runs/kept/<flow run>.json for a run that kept the champion; its path."""
    from training.model.model_ref import ModelRef, read_pointer

    root = StorageRoot.from_config(config)
    started = time.time()
    found, _ = root.fetch_versioned("models/champion")
    pointer = read_pointer(found) if found is not None else None
    champion = None if pointer is None else ModelRef(uri=pointer.uri, sha256=pointer.sha256,
                                                     meta_sha256=pointer.meta_sha256)
    rate, gpus = config.cost.rate()
    seconds = {"pack": packed.seconds, "decide": decision.seconds}
    report = KeptReport(
        decision=decision, dataset=packed.fingerprint, source=packed.source, rows=packed.rows, champion=champion,
        durations=seconds, compute=compute_cost(seconds, rate, gpus), tags=dict(config.cost.tags),
        prefect_flow_run_id=flow_run_id, storage=packed.storage)
    rel = f"runs/kept/{flow_run_id or time.strftime('local-%Y%m%dT%H%M%S', time.gmtime(started))}.json"
    path = root.path(rel)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, report.to_json())
    root.publish(rel, RUN)
    return str(path)
