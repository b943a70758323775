"""What every section of the config shares: its base model (unknown keys refused, assignments
validated), the metrics of each task, and the demo's columns."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["DEMO_CATEGORICAL", "DEMO_NUMERIC", "TASK_METRICS", "_Section", "metric_name"]

# The metrics of each data.task (their code: training.model.objectives), the first one the default.
TASK_METRICS: dict[str, tuple[str, ...]] = {
    "binary": ("auc", "logloss", "accuracy"),
    "multiclass": ("accuracy", "macro_f1", "logloss"),
    "regression": ("rmse", "mae", "r2"),
}


def metric_name(metric: str) -> str:
    """How messages name a metric ("AUC", as they always have; others by their key)."""
    return "AUC" if metric == "auc" else metric


DEMO_NUMERIC = ["price", "discount", "rating", "reviews_log", "position", "dwell_prev"]
DEMO_CATEGORICAL = ["category", "device", "region", "brand"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
