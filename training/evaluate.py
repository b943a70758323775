"""Test-split evaluation of a model package, and the champion/challenger promotion.

`<root>/models/<sha256>/` holds promoted model packages (content-addressed, written first);
`<root>/models/champion` is a small JSON pointer to one of them, replaced atomically. A crash
between the two writes leaves the old champion in place and an unreferenced package behind.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from training.config import EvalConfig
from training.data.features import FeatureStats
from training.data.loader import ShardBatches, iter_split
from training.data.packing import DatasetManifest
from training.metrics import accuracy, log_loss, roc_auc
from training.package import load_package, meta_sha256
from training.storage import read_json, write_json_atomic

__all__ = ["evaluate_package", "predict_split", "read_champion", "decide_promotion", "promote", "compatible",
           "EVAL_BATCH"]

EVAL_BATCH = 8192


def compatible(stats: FeatureStats, manifest: DatasetManifest) -> bool:
    return stats.numeric == manifest.numeric and stats.categorical == manifest.categorical


@torch.no_grad()
def predict_split(
    model: torch.nn.Module, batches: ShardBatches, device: torch.device, autocast: torch.dtype | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(probabilities, labels) for every row of an unshuffled split, in eval mode."""
    was_training = model.training
    model.eval()
    probs, labels = [], []
    for x_num, x_cat, y in iter_split(batches):
        with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            logits = model(x_num.to(device), x_cat.to(device))
        probs.append(torch.sigmoid(logits.float()).cpu().numpy())
        labels.append(y.numpy())
    model.train(was_training)
    return np.concatenate(probs), np.concatenate(labels)


def evaluate_package(
    package_dir: Path, dataset_dir: Path, manifest: DatasetManifest, trusted_factory: str | None,
    split: str = "test", expected_meta_sha256: str | None = None,
) -> dict[str, float]:
    """Exact AUC, log loss and accuracy of a model package on a split, with its own feature stats."""
    model, stats, _ = load_package(package_dir, trusted_factory, expected_meta_sha256)
    batches = ShardBatches(dataset_dir, manifest, split, EVAL_BATCH, stats.transformer(), shuffle=False, drop_last=False)
    p, y = predict_split(model, batches, torch.device("cpu"))
    return {"auc": roc_auc(y, p), "logloss": log_loss(y, p), "accuracy": accuracy(y, p), "rows": int(y.size)}


def read_champion(models_root: Path) -> dict[str, Any] | None:
    return read_json(models_root / "champion")


def decide_promotion(
    challenger_sha: str, challenger: dict[str, float], champion_sha: str | None, champion: dict[str, float] | None,
    config: EvalConfig, champion_problem: str | None = None,
) -> tuple[bool, str]:
    """Promote when the target is met and the champion is beaten by min_delta. An unusable
    champion (`champion_problem`) is not compared with: the challenger answers to the target
    alone, so a damaged champion never blocks retraining for ever."""
    auc = challenger["auc"]
    if config.target_auc is not None and auc < config.target_auc:
        return False, f"test AUC {auc:.4f} is below eval.target_auc {config.target_auc:.4f}"
    if champion_sha == challenger_sha and champion_problem is None:
        return False, "this model is already the champion"
    if champion is None and champion_problem is not None:
        target = "meets eval.target_auc" if config.target_auc is not None else "(no eval.target_auc set)"
        return True, (f"the champion {(champion_sha or '')[:12]} is unusable ({champion_problem}); "
                      f"judged alone: test AUC {auc:.4f} {target}")
    if champion is None:
        return True, f"no champion yet; test AUC {auc:.4f}"
    needed = champion["auc"] + config.min_delta
    if auc >= needed and auc > champion["auc"]:
        return True, f"test AUC {auc:.4f} beats the champion's {champion['auc']:.4f} by at least eval.min_delta {config.min_delta}"
    return False, f"test AUC {auc:.4f} does not beat the champion's {champion['auc']:.4f} by eval.min_delta {config.min_delta}"


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
    write_json_atomic(models_root / "champion", {**record, "sha256": sha256, "meta_sha256": meta_sha256(target),
                                                 "uri": uri or str(target / "model.pt")})
    return target


def champion_package(models_root: Path, pointer: dict[str, Any]) -> Path:
    return models_root / pointer["sha256"]


