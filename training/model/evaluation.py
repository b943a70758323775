"""Evaluation of a model package on a split of a dataset: every metric of its task, exact, with
the package's own preprocessing; and whether a package can read a dataset at all."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from training.data.features import FeatureStats
from training.data.loader import ShardBatches, iter_split
from training.data.manifest import DatasetManifest
from training.model.network import forward_fn, to_device
from training.model.package import load_package
from training.model.objectives import Task

log = logging.getLogger(__name__)

__all__ = ["evaluate_package", "predict_split", "compatible", "other_target", "EVAL_BATCH"]

EVAL_BATCH = 8192


def compatible(stats: FeatureStats, manifest: DatasetManifest) -> bool:
    """The package reads this dataset's columns (its feature statistics fit them)."""
    return (stats.numeric == manifest.numeric and stats.categorical == manifest.categorical
            and stats.vector == manifest.vector and stats.vector_dims == manifest.vector_dims
            and stats.text == manifest.text and stats.image == manifest.image)


def other_target(stats: FeatureStats, manifest: DatasetManifest) -> str | None:
    """Why a model with these statistics predicts something else than this dataset's label
    (another task, label or set of classes), or None when it predicts the same thing."""
    if stats.task != manifest.task:
        return f"it is a {stats.task} model and this run is {manifest.task}"
    if stats.label and stats.label != manifest.label:  # statistics written before labels were recorded: ""
        return f"it predicts label '{stats.label}' and this run predicts '{manifest.label}'"
    if stats.classes != manifest.classes:
        return f"its classes {stats.classes} differ from this dataset's {manifest.classes}"
    return None


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
        labels.append(batch["label"].numpy())
    model.train(was_training)
    return np.concatenate(preds), np.concatenate(labels)


def evaluate_package(
    package_dir: Path, dataset_dir: Path, manifest: DatasetManifest, trusted_factory: str | None,
    split: str | tuple[str, ...] = "test", expected_meta_sha256: str | None = None,
) -> dict[str, float]:
    """Every metric of the task (exact) of a model package on a split, with its own feature
    statistics, and the row count."""
    model, stats, _ = load_package(package_dir, trusted_factory, expected_meta_sha256)
    batches = ShardBatches(dataset_dir, manifest, split, EVAL_BATCH, stats.transformer(), shuffle=False, drop_last=False)
    task = Task.of(stats)
    pred, y = predict_split(model, task, batches, torch.device("cpu"))
    return {**task.evaluate(y, pred), "rows": int(y.size)}
