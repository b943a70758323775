"""What each supervised task means to training and evaluation: the model's outputs, the loss,
the predictions, the metrics and which way each metric is better.

One class per task, found by name in `TASKS`; `Task.of(stats)` binds one to a dataset's label
(its classes, or its fitted label transform). The packer's side of a task (which label values are
valid, how they are stored) is `training.data.labels`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from training.data.features import FeatureStats
from training.errors import ConfigError
from training.model.network import Batch, Forward
from training.model.target_transform import LabelTransform
from training.metrics import (accuracy, log_loss, mae, macro_f1, multiclass_accuracy, multiclass_log_loss, r2, rmse,
                              roc_auc)

__all__ = ["Metric", "Task", "TASKS", "higher_is_better", "metric_for", "is_better", "reaches"]


@dataclass(frozen=True)
class Metric:
    fn: Callable[[np.ndarray, np.ndarray], float]
    higher_is_better: bool


class Task:
    """A task bound to one dataset's label."""

    name: ClassVar[str]
    metrics: ClassVar[dict[str, Metric]]
    default_metric: ClassVar[str]

    def __init__(self, stats: FeatureStats) -> None:
        self.classes = list(stats.classes)

    @staticmethod
    def of(stats: FeatureStats) -> Task:
        return TASKS[stats.task](stats)

    @property
    def n_outputs(self) -> int:
        return 1

    def loss(self, output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The mean loss of a batch, in fp32 whatever precision the forward ran in."""
        raise NotImplementedError

    def predict(self, output: torch.Tensor) -> np.ndarray:
        """What the metrics score: probabilities, class probabilities, or values in label units."""
        raise NotImplementedError

    def forward_loss(self, forward: Forward, batch: Batch, device: torch.device,
                     dtype: torch.dtype | None) -> torch.Tensor:
        """The forward pass in the run's precision (no autocast context at all in fp32: nothing
        to enter every step), then the loss in fp32."""
        if dtype is None:
            return self.loss(forward(batch), batch["label"])
        with torch.autocast(device.type, dtype=dtype):
            output = forward(batch)
        return self.loss(output, batch["label"])

    def evaluate(self, y: np.ndarray, pred: np.ndarray) -> dict[str, float]:
        return {name: m.fn(y, pred) for name, m in self.metrics.items()}


class BinaryTask(Task):
    name, default_metric = "binary", "auc"
    metrics = {"auc": Metric(roc_auc, True), "logloss": Metric(log_loss, False), "accuracy": Metric(accuracy, True)}

    def loss(self, output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(output.float(), y)

    def predict(self, output: torch.Tensor) -> np.ndarray:
        return torch.sigmoid(output.float()).cpu().numpy()


class MulticlassTask(Task):
    name, default_metric = "multiclass", "accuracy"
    metrics = {"accuracy": Metric(multiclass_accuracy, True), "macro_f1": Metric(macro_f1, True),
               "logloss": Metric(multiclass_log_loss, False)}

    @property
    def n_outputs(self) -> int:
        return len(self.classes)

    def loss(self, output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.float(), y)

    def predict(self, output: torch.Tensor) -> np.ndarray:
        return torch.softmax(output.float(), dim=-1).cpu().numpy()


class RegressionTask(Task):
    """The model predicts the label transformed and standardised on the train split
    (`preprocess.target_transform`); predictions are converted back, so metrics and users see
    the label's own units."""

    name, default_metric = "regression", "rmse"
    metrics = {"rmse": Metric(rmse, False), "mae": Metric(mae, False), "r2": Metric(r2, True)}

    def __init__(self, stats: FeatureStats) -> None:
        super().__init__(stats)
        self.transform = LabelTransform(stats)

    def loss(self, output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output.float(), self.transform.target(y))

    def predict(self, output: torch.Tensor) -> np.ndarray:
        return self.transform(output.float().cpu()).numpy()


TASKS: dict[str, type[Task]] = {t.name: t for t in (BinaryTask, MulticlassTask, RegressionTask)}


def metric_for(task: str, configured: str | None) -> str:
    """eval.metric, or the task's default; a metric the task does not have is a ConfigError."""
    kind = TASKS[task]
    if configured is None:
        return kind.default_metric
    if configured not in kind.metrics:
        raise ConfigError(f"eval.metric: {configured!r} is not a {task} metric; use one of {sorted(kind.metrics)}")
    return configured


def is_better(task: str, metric: str, value: float, than: float, by: float = 0.0) -> bool:
    """`value` beats `than` by at least `by` in the metric's direction."""
    if higher_is_better(task, metric):
        return value >= than + by and value > than
    return value <= than - by and value < than


def higher_is_better(task: str, metric: str) -> bool:
    return TASKS[task].metrics[metric].higher_is_better


def reaches(task: str, metric: str, value: float, target: float) -> bool:
    """`value` is at `target` or beyond it in the metric's direction."""
    return value == target or is_better(task, metric, value, target)


