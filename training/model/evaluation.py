"""Test-split evaluation of a model package, and the champion/challenger promotion.

`<root>/models/<sha256>/` holds promoted model packages (content-addressed, written first);
`<root>/models/champion` is a small JSON pointer to one of them, replaced atomically. A crash
between the two writes leaves the old champion in place and an unreferenced package behind.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from training.config import EvalConfig, metric_name
from training.data.features import FeatureStats
from training.data.loader import ShardBatches, iter_split
from training.data.packing import DatasetManifest
from training.model.network import forward_fn
from training.model.package import load_package, meta_sha256
from training.storage.files import read_json, write_json_atomic
from training.model.objectives import Task, higher_is_better, is_better, reaches

log = logging.getLogger(__name__)

__all__ = ["evaluate_package", "predict_split", "read_champion", "decide_promotion", "promote", "compatible",
           "other_target", "EVAL_BATCH"]

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
            output = forward({k: v.to(device) for k, v in batch.items()})
        preds.append(task.predict(output))
        labels.append(batch["label"].numpy())
    model.train(was_training)
    return np.concatenate(preds), np.concatenate(labels)


def evaluate_package(
    package_dir: Path, dataset_dir: Path, manifest: DatasetManifest, trusted_factory: str | None,
    split: str = "test", expected_meta_sha256: str | None = None,
) -> dict[str, float]:
    """Every metric of the task (exact) of a model package on a split, with its own feature
    statistics, and the row count."""
    model, stats, _ = load_package(package_dir, trusted_factory, expected_meta_sha256)
    batches = ShardBatches(dataset_dir, manifest, split, EVAL_BATCH, stats.transformer(), shuffle=False, drop_last=False)
    task = Task.of(stats)
    pred, y = predict_split(model, task, batches, torch.device("cpu"))
    return {**task.evaluate(y, pred), "rows": int(y.size)}


def read_champion(models_root: Path) -> dict[str, Any] | None:
    return read_json(models_root / "champion")


def decide_promotion(
    challenger_sha: str, challenger: dict[str, float], champion_sha: str | None, champion: dict[str, float] | None,
    config: EvalConfig, champion_problem: str | None = None, task: str = "binary", metric: str = "auc",
) -> tuple[bool, str]:
    """Promote when the target is met and the champion is beaten by min_delta on `metric` (in
    its direction). An unusable champion (`champion_problem`) is not compared with: the
    challenger answers to the target alone, so a damaged champion never blocks retraining."""
    value, target = challenger[metric], config.target_value()
    name = metric_name(metric)
    key = "eval.target_auc" if metric == "auc" and config.target is None else "eval.target"
    if target is not None and not reaches(task, metric, value, target):
        side = "below" if higher_is_better(task, metric) else "above"
        return False, f"test {name} {value:.4f} is {side} {key} {target:.4f}"
    if champion_sha == challenger_sha and champion_problem is None:
        return False, "this model is already the champion"
    if champion is None and champion_problem is not None:
        meets = f"meets {key}" if target is not None else f"(no {key} set)"
        return True, (f"the champion {(champion_sha or '')[:12]} is unusable ({champion_problem}); "
                      f"judged alone: test {name} {value:.4f} {meets}")
    if champion is None:
        return True, f"no champion yet; test {name} {value:.4f}"
    theirs = champion.get(metric)
    if theirs is None:  # recorded metrics of a champion judged on another metric
        return False, f"the champion has no recorded test {name} to compare with; promotion skipped"
    if is_better(task, metric, value, theirs, config.min_delta):
        return True, f"test {name} {value:.4f} beats the champion's {theirs:.4f} by at least eval.min_delta {config.min_delta}"
    return False, f"test {name} {value:.4f} does not beat the champion's {theirs:.4f} by eval.min_delta {config.min_delta}"


def promote(models_root: Path, package_dir: Path, sha256: str, record: dict[str, Any], uri: str | None = None) -> Path:
    """Copy the package to models/<sha256>/ (first), then swap the champion pointer (last)."""
    target = models_root / sha256
    if (target / "model.json").exists() and meta_sha256(target) != meta_sha256(package_dir):
        shutil.rmtree(target)  # a damaged copy of this very package: replace it with the verified one
    if not (target / "model.json").exists():
        tmp = models_root / f".{sha256}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(package_dir, tmp)
        os.replace(tmp, target) if not target.exists() else shutil.rmtree(tmp)
    pointer = models_root / "champion"
    if pointer.is_dir() and not pointer.is_symlink():
        # A folder where the pointer belongs (found unusable before this promotion): it must not
        # block every later one. Set aside, not deleted: it is somebody's.
        aside = models_root / f"champion.not-a-pointer-{uuid.uuid4().hex[:8]}"
        pointer.rename(aside)
        log.warning("models/champion was a folder, not a pointer; moved to %s", aside)
    write_json_atomic(pointer, {**record, "sha256": sha256, "meta_sha256": meta_sha256(target),
                                                 "uri": uri or str(target / "model.pt")})
    return target


def champion_package(models_root: Path, pointer: dict[str, Any]) -> Path:
    return models_root / pointer["sha256"]


