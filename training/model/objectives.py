"""What each supervised task means to training and evaluation: the model's outputs, the loss,
the predictions, and its metrics (defined, with which way each is better, in the torch-free
`training.model.task_metrics`).

One class per task, found by name in `TASKS`; `Task.of(stats)` binds one to a dataset's label
(its classes, or its fitted label transform). The packer's side of a task (which label values are
valid, how they are stored) is `training.data.ingest.labels`.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from training.data.prepare.features import FeatureStats
from training.data.batch import Batch, present
from training.model.network import Forward
from training.model.target_transform import LabelTransform
from training.model.task_metrics import DEFAULT_METRIC, METRICS, Metric

__all__ = ["Task", "TASKS"]


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
                     dtype: torch.dtype | None, cache: bool = True) -> torch.Tensor:
        """The forward pass in the run's precision (no autocast context at all in fp32: nothing
        to enter every step), then the loss in fp32. `cache=False` under CUDA-graph capture:
        autocast's cache of cast weights would be an address the graph keeps."""
        if dtype is None:
            return self.loss(forward(batch), present(batch.label, "label"))
        with torch.autocast(device.type, dtype=dtype, cache_enabled=cache):
            output = forward(batch)
        return self.loss(output, present(batch.label, "label"))

    def evaluate(self, y: np.ndarray, pred: np.ndarray) -> dict[str, float]:
        return {name: m.fn(y, pred) for name, m in self.metrics.items()}


class BinaryTask(Task):
    name = "binary"
    metrics, default_metric = METRICS[name], DEFAULT_METRIC[name]

    def loss(self, output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(output.float(), y)

    def predict(self, output: torch.Tensor) -> np.ndarray:
        return torch.sigmoid(output.float()).cpu().numpy()


class MulticlassTask(Task):
    name = "multiclass"
    metrics, default_metric = METRICS[name], DEFAULT_METRIC[name]

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

    name = "regression"
    metrics, default_metric = METRICS[name], DEFAULT_METRIC[name]

    def __init__(self, stats: FeatureStats) -> None:
        super().__init__(stats)
        self.transform = LabelTransform(stats)

    def loss(self, output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output.float(), self.transform.target(y))

    def predict(self, output: torch.Tensor) -> np.ndarray:
        return self.transform(output.float().cpu()).numpy()


TASKS: dict[str, type[Task]] = {t.name: t for t in (BinaryTask, MulticlassTask, RegressionTask)}
