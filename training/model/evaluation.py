"""Evaluation of a model package on a split of a dataset: every metric of its task, exact, with
the package's own preprocessing. Whether a package can read a dataset at all is
`training.model.compatibility`, which needs no torch."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from training.data.batch import present
from training.data.load.loader import ShardBatches, iter_split
from training.data.manifest import DatasetManifest
from training.model.network import forward_fn, to_device
from training.model.objectives import Task
from training.model.package import load_package

log = logging.getLogger(__name__)

__all__ = ["EVAL_BATCH", "PackageScores", "evaluate_package", "predict_split", "score_package"]

EVAL_BATCH = 8192


@torch.no_grad()
def predict_split(
    model: torch.nn.Module, task: Task, batches: ShardBatches, device: torch.device,
    autocast: torch.dtype | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(predictions, labels) for every row of an unshuffled split, in eval mode: probabilities
    (binary), class probabilities (multiclass) or values in the label's units (regression)."""
    was_training = model.training
    model.eval()
    forward = forward_fn(model)
    preds, labels = [], []
    for batch in iter_split(batches):
        with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            output = forward(to_device(batch, device))
        preds.append(task.predict(output))
        labels.append(present(batch.label, "label").numpy())
    model.train(was_training)
    return np.concatenate(preds), np.concatenate(labels)


def evaluate_package(
    package_dir: Path, dataset_dir: Path, manifest: DatasetManifest, trusted_factory: str | None,
    split: str | tuple[str, ...] = "test", expected_meta_sha256: str | None = None, classes: list[Any] | None = None,
) -> dict[str, float]:
    """Every metric of the task (exact) of a model package on a split, with its own feature
    statistics, and the row count. A multiclass package is scored on the rows of the classes
    it knows (and of `classes`, when given), in its own class indices."""
    return score_package(package_dir, dataset_dir, manifest, trusted_factory, split, expected_meta_sha256,
                         classes).metrics


@dataclass(frozen=True)
class PackageScores:
    """A package's metrics on a split and the predictions they came from: `y` in the package's
    own class indices, `rows` the split's rows scored (all, or those of the classes kept)."""

    metrics: dict[str, float]
    y: np.ndarray
    pred: np.ndarray
    rows: np.ndarray


def score_package(
    package_dir: Path, dataset_dir: Path, manifest: DatasetManifest, trusted_factory: str | None,
    split: str | tuple[str, ...] = "test", expected_meta_sha256: str | None = None, classes: list[Any] | None = None,
) -> PackageScores:
    """`evaluate_package`, with the predictions (to compare two models row by row)."""
    model, stats, _ = load_package(package_dir, trusted_factory, expected_meta_sha256)
    batches = ShardBatches(dataset_dir, manifest, split, EVAL_BATCH, stats.transformer(), shuffle=False, drop_last=False)
    task = Task.of(stats)
    pred, y = predict_split(model, task, batches, torch.device("cpu"))
    rows = np.arange(y.size)
    if stats.task == "multiclass" and (classes is not None or stats.classes != manifest.classes):
        pred, y, rows = _rows_of_classes(pred, y, manifest.classes, stats.classes, classes)
    return PackageScores({**task.evaluate(y, pred), "rows": int(y.size)}, y, pred, rows)


def _rows_of_classes(pred: np.ndarray, y: np.ndarray, dataset: list[Any], model: list[Any],
                     keep: list[Any] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows whose class the model knows (and is in `keep`), their labels as the model's
    class indices: a dataset's classes are its train split's, sorted, so a class new since the
    model was trained shifts the indices of the classes after it."""
    index = {value: i for i, value in enumerate(model)}
    wanted = set(model if keep is None else keep) & set(index)
    to_model = np.array([index[v] if v in wanted else -1 for v in dataset], dtype=np.int64)
    mapped = to_model[y.astype(np.int64)]
    rows = mapped >= 0
    return pred[rows], mapped[rows], np.flatnonzero(rows)
