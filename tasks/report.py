from __future__ import annotations

import os
from pathlib import Path

from prefect import task
from prefect.states import Completed, State

from tasks.artifacts import announce_champion_kept, announce_run_completed, publish_config, publish_report
from tasks.policies import HOUR
from training.config import RetrainConfig
from training.pipeline.handoffs import (
    Evaluation,
    LaunchPhases,
    PackResult,
    PrepResult,
    StageEnds,
    StageStates,
    TrainingDecision,
)
from training.pipeline.report_stage import kept_report_stage, report_stage
from training.pipeline.reports.run_report import RunReport
from training.protocol.results import TrainResult

__all__ = ["StageEnds", "StageStates", "finished", "keep_champion", "write_report"]  # the flow records both for the report


@task(name="report", timeout_seconds=HOUR)
def write_report(
    config: RetrainConfig, packed: PackResult, prep: PrepResult, trained: TrainResult,
    evaluation: Evaluation, stage_states: StageStates, flow_run_id: str | None = None,
    stage_ends: StageEnds | None = None, decision: TrainingDecision | None = None,
) -> str:
    """Write runs/<run_key>/report.json, report.md and curves.png; publish them as artifacts.
    `stage_ends`: when the flow began and each stage ended."""
    launched = os.environ.get(LaunchPhases.ENV)  # set by `retrain run` around its flow call
    launch = LaunchPhases.model_validate_json(launched) if launched else None
    paths = report_stage(config, packed, prep, trained, evaluation, stage_states, flow_run_id, launch, stage_ends,
                         decision)
    report = RunReport.read(Path(paths.report))
    publish_report(report, Path(paths.curves) if paths.curves else None)
    publish_config(config, report)
    announce_run_completed(report, paths.report)
    return paths.report


@task(name="keep-champion", timeout_seconds=HOUR)
def keep_champion(config: RetrainConfig, packed: PackResult, decision: TrainingDecision,
                  flow_run_id: str | None = None) -> str:
    """A run with nothing to learn: runs/kept/<flow run>.json says why; the champion stays."""
    path = kept_report_stage(config, packed, decision, flow_run_id)
    announce_champion_kept(decision, path)
    return path


def finished(trained: TrainResult, report_path: str) -> str | State:
    """The flow's end: the report's path, and where a budget stopped training, a Completed state
    whose message says so. The UI lists state messages beside runs, and a run the budget cut
    short must not look like a full one."""
    if trained.status != "budget_stopped":
        return report_path
    return Completed(message=f"budget stopped at step {trained.steps}: {trained.stop_reason}; the model is the best "
                     f"validated before the stop (report: {report_path})", data=report_path)
