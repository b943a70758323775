"""Prefect UI artifacts built from the small dicts the stages return."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast
from uuid import UUID

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.context import FlowRunContext, TaskRunContext
from prefect.events import emit_event

from training.config import RetrainConfig
from training.pipeline.handoffs import Evaluation, TrainingDecision

if TYPE_CHECKING:  # the retrain flow imports this module: no Optuna for it
    from training.pipeline.reports.run_report import RunReport
    from training.tune.study_report import TuneReport

__all__ = ["promotion_payload", "announce_run_completed", "announce_champion_kept", "publish_config", "publish_decision", "publish_promotion",
           "publish_report", "publish_tune_report", "TrainingProgress", "PROMOTED_EVENT", "RUN_COMPLETED_EVENT", "CHAMPION_KEPT_EVENT"]

# Hang an Automation on this (README, "Notify on promotion"): resource id retrain.model.<sha256>.
PROMOTED_EVENT = "retrain.model.promoted"
# Emitted by every retrain flow run as its last act: resource id retrain.run.<run_key>, related to
# the flow run and its deployment. The predict deployment's trigger listens for it: Prefect's own
# flow-run state events of a run its scheduler created reach triggers only after their 15-minute
# look-back (the scheduler stores no Scheduled event for it), this one at once.
RUN_COMPLETED_EVENT = "retrain.run.completed"
# Emitted instead when a run kept the champion (train.retrain_when): nothing new to score with.
CHAMPION_KEPT_EVENT = "retrain.run.kept-champion"


def in_run() -> bool:
    # .fn() calls in tests run outside any Prefect run; the tune report is published by the flow.
    return TaskRunContext.get() is not None or FlowRunContext.get() is not None


def publish_promotion(evaluation: Evaluation) -> None:
    if not in_run():
        return
    promo, challenger = evaluation.promotion, evaluation.metrics
    champion = promo.champion_metrics or {}
    metrics = [k for k in challenger if k != "rows"]
    rows = [{"model": "challenger", "sha256": promo.challenger_sha256[:16],
             **{k: round(challenger[k], 5) for k in metrics}}]
    if promo.champion_sha256:
        rows.append({"model": "champion", "sha256": promo.champion_sha256[:16],
                     **{k: round(champion[k], 5) if k in champion else None for k in metrics}})
    create_table_artifact(rows, key="champion-challenger", description="Test-split metrics of challenger and champion")
    if promo.promoted:
        emit_event(
            event=PROMOTED_EVENT,
            resource={"prefect.resource.id": f"retrain.model.{promo.challenger_sha256}",
                      "prefect.resource.name": promo.challenger_sha256[:16]},
            payload=promotion_payload(evaluation, _flow_run_facts()),
        )
    verdict = "PROMOTED" if promo.promoted else "champion kept"
    note = f"\n\n_{promo.champion_note}_" if promo.champion_note else ""
    create_markdown_artifact(
        f"### {verdict}\n\n{promo.reason}{note}\n\n"
        f"target {evaluation.metric}: {evaluation.target} (met: {evaluation.target_met})",
        key="promotion-decision",
        description="Champion/challenger decision",
    )


def promotion_payload(evaluation: Evaluation, run: dict[str, str | None]) -> dict[str, Any]:
    """What a promotion notification says: the models by their short names, the metric it was
    judged on by name and rounded, and the flow run (name, deployment, a link to it in the UI)."""
    from training.config import metric_name

    promo, challenger = evaluation.promotion, evaluation.metrics
    value = challenger.get(evaluation.metric)
    return {"sha256": promo.challenger_sha256, "short": promo.challenger_sha256[:12],
            **{k: v for k, v in challenger.items() if k != "rows"},
            "metric": evaluation.metric,
            "metric_text": f"test {metric_name(evaluation.metric)} {value:.4f}" if value is not None else "",
            "previous_champion_sha256": promo.champion_sha256,
            "previous_short": promo.champion_sha256[:12] if promo.champion_sha256 else "no champion",
            "reason": promo.reason, **run}


def _flow_run_facts() -> dict[str, str | None]:
    from prefect import runtime
    from prefect.settings import get_current_settings

    run_id = runtime.flow_run.id
    ui = get_current_settings().ui_url
    return {"flow_run_id": run_id, "flow_run_name": runtime.flow_run.name, "deployment": runtime.deployment.name,
            "flow_run_url": f"{str(ui).rstrip('/')}/runs/flow-run/{run_id}" if ui and run_id else None}


def publish_report(report: RunReport, curves: Path | None) -> None:
    if not in_run():
        return
    from training.pipeline.reports.markdown import render_markdown

    cost = report.cost
    rows = [
        _cost_row("compute (this run)", cost.compute.usd, cost.compute.gpu_hours, cost.compute.billed_seconds),
        *[_cost_row(f"  stage {k}", v) for k, v in cost.compute.per_stage_usd.items()],
        _cost_row("storage (retention)", cost.storage.total_usd),
        _cost_row("naive run (on-demand, fp32, no early stop, never preempted; with its storage)",
                  cost.naive.total_usd, cost.naive.gpu_hours, cost.naive.seconds),
        _cost_row("naive run on this market (restarts from zero at each of this run's preemptions; with its storage)",
                  cost.naive_restarting.total_usd, cost.naive_restarting.gpu_hours, cost.naive_restarting.seconds),
        _cost_row("saved against the naive on-demand run", cost.savings_usd),
    ]
    create_table_artifact(rows, key="run-cost", description=f"{cost.instance_type} on {cost.market}; tags {cost.tags}")
    create_markdown_artifact(render_markdown(report, curves, embed=True), key="run-report",
                             description=f"Report of run {report.run_key}")


def publish_config(config: RetrainConfig, report: RunReport) -> None:
    """The config this run used, whole (its deployment's merged with the run's own parameters,
    a plan's pick applied), with what it cost: the Parameters tab shows only what the run set."""
    if not in_run():
        return
    import yaml

    cost = report.cost
    text = yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
    create_markdown_artifact(
        f"Run {report.run_key} cost ${cost.total_usd:.6f} on {cost.instance_type} ({cost.market}). "
        f"The config it ran with, as `retrain run --config` takes it:\n\n```yaml\n{text}```\n",
        key="effective-config", description="The whole config of this run, and its cost")


def _cost_row(item: str, usd: float, gpu_hours: float | None = None, seconds: float | None = None) -> dict[str, Any]:
    return {"item": item, "usd": round(usd, 6), "gpu_hours": None if gpu_hours is None else round(gpu_hours, 6),
            "seconds": None if seconds is None else round(seconds, 2)}


def announce_run_completed(report: RunReport, report_path: str) -> None:
    """The project's own completion event (see RUN_COMPLETED_EVENT)."""
    if not in_run():
        return
    promotion = report.promotion
    value = report.metrics.get(report.metric)
    storage = report.storage
    # Where a reader opens it: the S3 object on an s3:// root (a worker's local copy is not theirs).
    where = f"{storage.run_uri.rstrip('/')}/report.json" if storage.remote and storage.run_uri else report_path
    emit_event(
        event=RUN_COMPLETED_EVENT,
        # The status as a label too: an automation can match labels, not payloads
        # (deployments/automations/notify-budget-stopped-runs.yaml).
        resource={"prefect.resource.id": f"retrain.run.{report.run_key}", "prefect.resource.name": report.run_key,
                  "retrain.run.status": report.status},
        payload={"run_key": report.run_key, "status": report.status, "stop_reason": report.stop_reason,
                 "report": where, "metric": report.metric,
                 "value": value, "model_sha256": report.model.sha256,
                 "metric_text": f"model's test {report.metric} is {value:.4f}" if value is not None else "",
                 "cost_text": f"${report.cost.compute.usd:.4f} of compute", "steps": report.steps,
                 "promoted": promotion.promoted,
                 "champion_sha256": promotion.challenger_sha256 if promotion.promoted else promotion.champion_sha256,
                 **_flow_run_facts()},
    )


def publish_tune_report(report: TuneReport, png_bytes: bytes) -> None:
    if not in_run():
        return
    rows = [{"trial": r.number, **r.params, "state": r.state,
             "rung": r.rung, "steps": r.steps, report.metric: None if r.value is None else round(r.value, 5),
             "usd": round(r.usd, 6), "gpu_hours": round(r.gpu_hours, 6), "seconds": round(r.billed_seconds, 2)}
            for r in report.trials]
    create_table_artifact(rows, key="tune-trials", description=f"Trials of study {report.study}")
    best = report.best
    image = base64.b64encode(png_bytes).decode()
    create_markdown_artifact(
        f"### Study {report.study}: {report.status}\n\n"
        f"Spent ${report.spend.usd:.6f} ({report.spend.seconds:.1f} machine-s, {report.spend.gpu_hours:.6f} GPU-h) "
        f"against budget {report.budget}; every trial at full fidelity on {report.market} would cost "
        f"${report.naive.usd:.6f} ({report.naive.seconds:.1f} machine-s).\n\n"
        + (f"Best: trial {best.trial}, validation {report.metric} {best.value:.5f}, {best.params}"
           + (f", ranked by the mean last validation over {best.seeds} seeds" if best.seeds > 1 else "")
           + (f" ({best.evidence})" if best.evidence else "") + "\n\n"
           if best else "No trial reached full fidelity.\n\n")
        + f"![metric against cumulative cost](data:image/png;base64,{image})\n",
        key="tune-report", description=f"Tuning study {report.study}")


class TrainingProgress:
    """A progress artifact in the Prefect UI, updated at each validation."""

    def __init__(self, max_steps: int) -> None:
        self.max_steps = max_steps
        # Called in a sync task: Prefect's sync-compatible helpers return the value itself there.
        self.artifact_id: UUID | None = (
            cast(UUID, create_progress_artifact(0.0, key="training-progress", description="Optimizer steps done"))
            if in_run() else None
        )

    def update(self, step: int) -> None:
        if self.artifact_id is not None:
            update_progress_artifact(self.artifact_id, 100.0 * step / self.max_steps)


def publish_decision(decision: TrainingDecision) -> None:
    """Why this run trains or keeps the champion: a markdown artifact with the drift table."""
    if not in_run():
        return
    verdict = "trains" if decision.train else "keeps the champion"
    lines = [f"**This run {verdict}**: {decision.reason}.", ""]
    if decision.new_segments:
        lines.append(f"New since the champion was trained: {decision.new_segments} segment(s), {decision.new_rows} rows.")
    if decision.drift:
        lines += ["", f"| feature | PSI | over {decision.threshold:g} |", "|---|---:|:-:|"]
        for name, value in sorted(decision.drift.items(), key=lambda kv: -kv[1]):
            lines.append(f"| {name} | {value:.4f} | {'yes' if name in decision.drifted else ''} |")
    create_markdown_artifact("\n".join(lines), key="training-decision",
                             description="train.retrain_when: drift and the champion's score on the new data")


def announce_champion_kept(decision: TrainingDecision, report_path: str) -> None:
    if not in_run():
        return
    emit_event(
        event=CHAMPION_KEPT_EVENT,
        resource={"prefect.resource.id": f"retrain.model.{decision.champion_sha256}"},
        payload={"reason": decision.reason, "report": report_path, "drifted": decision.drifted},
    )
