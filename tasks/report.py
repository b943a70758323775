from __future__ import annotations

from typing import Any

from prefect import task

from training.stages import report_stage

__all__ = ["write_report"]


@task(name="report")
def write_report(
    packed: dict[str, Any], prep: dict[str, Any], trained: dict[str, Any], evaluation: dict[str, Any],
    stage_states: dict[str, str],
) -> str:
    """Write runs/<run_key>/report.json and return its path."""
    return report_stage(packed, prep, trained, evaluation, stage_states)
