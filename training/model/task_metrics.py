"""Each task's metrics and which way each is better: what the flow's process needs to judge a
result (the champion gate, promotion, early stopping's direction) without importing torch.
The tasks' losses and predictions, which do need it, are `training.model.objectives`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from training.errors import ConfigError
from training.metrics import (accuracy, log_loss, mae, macro_f1, multiclass_accuracy, multiclass_log_loss, r2, rmse,
                              roc_auc)

__all__ = ["DEFAULT_METRIC", "METRICS", "Metric", "TIEBREAK_METRIC", "higher_is_better", "is_better", "metric_for", "reaches"]


@dataclass(frozen=True)
class Metric:
    fn: Callable[[np.ndarray, np.ndarray], float]
    higher_is_better: bool


METRICS: dict[str, dict[str, Metric]] = {
    "binary": {"auc": Metric(roc_auc, True), "logloss": Metric(log_loss, False), "accuracy": Metric(accuracy, True)},
    "multiclass": {"accuracy": Metric(multiclass_accuracy, True), "macro_f1": Metric(macro_f1, True),
                   "logloss": Metric(multiclass_log_loss, False)},
    "regression": {"rmse": Metric(rmse, False), "mae": Metric(mae, False), "r2": Metric(r2, True)},
}
DEFAULT_METRIC = {"binary": "auc", "multiclass": "accuracy", "regression": "rmse"}
# What breaks a tie of eval.metric between validations (early stopping keeps the step with the
# lower one): the task's loss, continuous where accuracy and AUC on a small split are coarse.
TIEBREAK_METRIC = {"binary": "logloss", "multiclass": "logloss", "regression": "rmse"}


def metric_for(task: str, configured: str | None) -> str:
    """eval.metric, or the task's default; a metric the task does not have is a ConfigError."""
    if configured is None:
        return DEFAULT_METRIC[task]
    if configured not in METRICS[task]:
        raise ConfigError(f"eval.metric: {configured!r} is not a {task} metric; use one of {sorted(METRICS[task])}")
    return configured


def is_better(task: str, metric: str, value: float, than: float, by: float = 0.0) -> bool:
    """`value` beats `than` by at least `by` in the metric's direction."""
    if higher_is_better(task, metric):
        return value >= than + by and value > than
    return value <= than - by and value < than


def higher_is_better(task: str, metric: str) -> bool:
    return METRICS[task][metric].higher_is_better


def reaches(task: str, metric: str, value: float, target: float) -> bool:
    """`value` is at `target` or beyond it in the metric's direction."""
    return value == target or is_better(task, metric, value, target)
