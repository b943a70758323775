"""Right-sizing before renting: each candidate instance's predicted step time, memory fit,
expected hours and cost; the pick is what `cost.instance_type: auto` runs take."""

from __future__ import annotations

from prefect import flow

from tasks.plan import plan_instances
from tasks.policies import FLOW_TIMEOUTS, apply_credentials_block
from tasks.runtime import checked_columns, effective_config, plan_run_name
from training.config import RetrainConfig

__all__ = ["plan"]


@flow(name="plan", timeout_seconds=FLOW_TIMEOUTS.plan, flow_run_name=plan_run_name, log_prints=True)
def plan(
    instance_types: list[str] | None = None,
    deadline_hours: float | None = None,
    calibration_steps: int = 50,
    config: RetrainConfig = RetrainConfig(),  # noqa: B008 - pydantic default renders in the UI
) -> str | None:
    """Plan `instance_types` against `deadline_hours`; returns the recommended instance type, or
    None when nothing fits and meets the deadline.

    Args:
        instance_types: Keys of cost.prices to compare (empty: every priced type).
        deadline_hours: The run must end within this many hours with 90 % probability (empty: no
            deadline, the cheapest wins).
        calibration_steps: Optimizer steps the calibration times on this machine (the first
            fifth, the warm-up, is left out of the per-step figure).
        config: The run to plan: its data, model and training settings.
    """
    config = effective_config(config, planned_instance=False)  # plan makes the pick auto runs take
    apply_credentials_block(config.storage)
    config = checked_columns(config)
    report = plan_instances(config, instance_types or sorted(config.cost.prices), deadline_hours, calibration_steps)
    return report.cheapest.instance_type if report.cheapest is not None else None
