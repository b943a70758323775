"""Dollars and GPU-hours: prices, the run's bill and the naive counterfactual.

All arithmetic is `rate x time` on measured seconds; nothing here guesses a runtime.
"""

from __future__ import annotations


from pydantic import BaseModel, ConfigDict
from training.copies import updated

__all__ = [
    "SECONDS_PER_HOUR",
    "ComputeCost",
    "CostReport",
    "Counterfactual",
    "StorageCost",
    "StoredClass",
    "compute_cost",
    "storage_cost",
    "naive_counterfactual",
    "restarting_counterfactual",
]

SECONDS_PER_HOUR = 3600.0
GB = 1e9
DAYS_PER_MONTH = 30.0


class _Figure(BaseModel):
    # Read back from report.json files of any version: keys they lack take their defaults.
    model_config = ConfigDict(extra="ignore")


class ComputeCost(_Figure):
    """Billed compute: every second the machine was held, per stage, times the hourly rate."""

    billed_seconds: float
    usd: float
    gpu_hours: float
    per_stage_usd: dict[str, float]


class StoredClass(_Figure):
    bytes: int
    storage_class: str
    retention_days: float
    usd: float


class StorageCost(_Figure):
    """$ to keep each object class for its configured retention."""

    shards: StoredClass
    checkpoints: StoredClass
    models: StoredClass
    total_usd: float


class Counterfactual(_Figure):
    """The same job done another way, priced from this run's measured pace."""

    seconds: float
    steps: int
    fp32_slowdown: float | None  # None: not measured, the naive run priced at this run's step time
    usd: float
    gpu_hours: float
    storage_usd: float = 0.0
    total_usd: float = 0.0
    steps_redone: int | None = None  # the restarting counterfactual only
    preemptions: int | None = None
    rate_per_hour: float | None = None

    def with_storage(self, storage_usd: float) -> Counterfactual:
        return updated(self, {"storage_usd": storage_usd, "total_usd": self.usd + storage_usd})


def compute_cost(stage_seconds: dict[str, float], rate_per_hour: float, gpus: int) -> ComputeCost:
    """Billed compute: every second the machine was held, per stage, times the hourly rate."""
    total = sum(stage_seconds.values())
    return ComputeCost(billed_seconds=total, usd=rate_per_hour * total / SECONDS_PER_HOUR,
                       gpu_hours=gpus * total / SECONDS_PER_HOUR,
                       per_stage_usd={k: rate_per_hour * v / SECONDS_PER_HOUR for k, v in stage_seconds.items()})


def storage_cost(bytes_by_class: dict[str, int], storage_classes: dict[str, str], prices_per_gb_month: dict[str, float],
                 retention_days: dict[str, float]) -> StorageCost:
    """$ to keep each object class (shards, checkpoints, models) for its configured retention
    (GB x $/GB-month x months)."""
    priced = {}
    for cls in ("shards", "checkpoints", "models"):
        storage_class, size = storage_classes[cls], bytes_by_class[cls]
        months = retention_days[cls] / DAYS_PER_MONTH
        priced[cls] = StoredClass(bytes=size, storage_class=storage_class, retention_days=retention_days[cls],
                                  usd=size / GB * prices_per_gb_month[storage_class] * months)
    return StorageCost(**priced, total_usd=sum(c.usd for c in priced.values()))


def naive_counterfactual(
    *,
    other_stage_seconds: float,
    train_seconds_per_step: float,
    naive_steps: int,
    fp32_slowdown: float | None,
    on_demand_per_hour: float,
    gpus: int,
) -> Counterfactual:
    """The same job done the naive way: on-demand, fp32, no early stopping, no preemptions.

    `train_seconds_per_step` is the measured time of one optimizer step (compute, data wait,
    evaluation and checkpoint time spread over the steps); `fp32_slowdown` is measured fp32 step
    time over this run's step time (1.0 when this run already trained in fp32; None when it was not
    measured: this run's step time stands in for it).
    """
    seconds = other_stage_seconds + train_seconds_per_step * (fp32_slowdown or 1.0) * naive_steps
    return Counterfactual(seconds=seconds, steps=naive_steps, fp32_slowdown=fp32_slowdown,
                          usd=on_demand_per_hour * seconds / SECONDS_PER_HOUR, gpu_hours=gpus * seconds / SECONDS_PER_HOUR)


def restarting_counterfactual(
    *,
    naive: Counterfactual,
    steps_reached_at_preemptions: list[int],
    train_seconds_per_step: float,
    restart_seconds: float,
    rate_per_hour: float,
    gpus: int,
) -> Counterfactual:
    """The naive job on this run's market, under this run's preemptions: with no checkpoints,
    each preemption throws away every step done so far and pays a restart."""
    redone = sum(min(step, naive.steps) for step in steps_reached_at_preemptions)
    extra = redone * train_seconds_per_step * (naive.fp32_slowdown or 1.0) + restart_seconds * len(steps_reached_at_preemptions)
    seconds = naive.seconds + extra
    return Counterfactual(seconds=seconds, steps=naive.steps, steps_redone=redone,
                          preemptions=len(steps_reached_at_preemptions), fp32_slowdown=naive.fp32_slowdown,
                          rate_per_hour=rate_per_hour, usd=rate_per_hour * seconds / SECONDS_PER_HOUR,
                          gpu_hours=gpus * seconds / SECONDS_PER_HOUR)


class CostReport(_Figure):
    """The bill of a run from measured seconds and bytes, and the counterfactuals it is held
    against (report.json's `cost`)."""

    instance_type: str
    market: str
    rate_per_hour: float
    gpus: int
    compute: ComputeCost
    gpu_hours: float
    storage: StorageCost
    total_usd: float
    naive: Counterfactual
    savings_usd: float
    savings_fraction: float
    naive_restarting: Counterfactual
    savings_vs_restarting_usd: float
    tags: dict[str, str] = {}
    # The instance was declared (cost.instance_type), not the machine the run used: a GPU type on
    # a run that trained on the CPU, or a CPU type on a run that trained on a GPU.
    declared_on: str | None = None  # where it did run ("the CPU", "a CUDA GPU"); None: it matches

    def where(self) -> str:
        """"g4dn.xlarge (spot)", with what the run really ran on when that was not it."""
        ran = f"; declared in cost.instance_type, this run ran on {self.declared_on}" if self.declared_on else ""
        return f"{self.instance_type} ({self.market}{ran})"
