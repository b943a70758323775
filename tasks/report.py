from __future__ import annotations

from pathlib import Path

from prefect import task

from tasks.artifacts import publish_report
from training.config import RetrainConfig
from training.results import Evaluation, PackResult, PrepResult, TrainResult
from training.stages import report_stage

__all__ = ["write_report"]


@task(name="report")
def write_report(
    config: RetrainConfig, packed: PackResult, prep: PrepResult, trained: TrainResult,
    evaluation: Evaluation, stage_states: dict[str, str], flow_run_id: str | None = None,
) -> str:
    """Write runs/<run_key>/report.json, report.md and curves.png; publish them as artifacts."""
    paths = report_stage(config, packed, prep, trained, evaluation, stage_states, flow_run_id)
    publish_report(Path(paths["report"]), Path(paths["curves"]) if paths["curves"] else None)
    return paths["report"]
