"""`retrain plan` as a Prefect task: the plan, and its ranked table as an artifact in the UI."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from typing import TYPE_CHECKING

from tasks.policies import HOUR, task_logger
from training.config import RetrainConfig

if TYPE_CHECKING:  # the plan's calibration trains: torch only when it runs
    from training.pipeline.plan_stage import PlanReport

__all__ = ["plan_instances"]


@task(name="plan", timeout_seconds=6 * HOUR)
def plan_instances(config: RetrainConfig, instance_types: list[str], deadline_hours: float | None,
                   calibration_steps: int) -> PlanReport:
    """Calibrate, predict and rank; the table and the recommendation as artifacts."""
    from training.pipeline.plan_stage import plan_run

    plan = plan_run(config, instance_types, deadline_hours, calibration_steps)
    create_table_artifact([r.cells() for r in plan.rows], key="plan-instances",
                          description="Candidates, fitting ones that meet the deadline first, cheapest first")
    set_keys = " ".join(f"`--set {k}={v}`" for k, v in (plan.cheapest.set if plan.cheapest else {}).items())
    create_markdown_artifact(f"**Recommended:** {plan.why}" + (f"\n\nSet {set_keys}." if set_keys else ""),
                             key="plan-recommendation", description="retrain plan's pick and why")
    task_logger().info("plan: %s", plan.why)
    return plan
