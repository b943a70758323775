"""The model package format, in one place: what a package holds, how it is written, how it is
read back and verified.

    model.pt     the best checkpoint's weights (a plain state dict, loadable weights_only)
    model.json   sha256 of the weights, run key, best step, validation metric, model config,
                 feature statistics and cost tags

The sha256 of model.json covers every file (it holds the weights' sha256), so champion pointers
and train results record that one hash.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch

from training.config import RetrainConfig
from training.data.prepare.features import FeatureStats
from training.errors import CheckpointError
from training.model.model_ref import ModelRef
from training.model.network import ModelSchema, weights_sha256
from training.model.spec import build_model
from training.model.package_meta import PackageMeta, ValMetric
from training.storage.files import write_json_atomic

__all__ = ["UntrustedFactory", "export_model_package", "load_package", "load_warm_start", "meta_sha256",
           "package_stats"]

log = logging.getLogger(__name__)


class UntrustedFactory(CheckpointError):
    """A package names a model factory that is not the running config's: never imported."""


def meta_sha256(package_dir: Path) -> str:
    """The sha256 of a package's model.json, which holds the weights' sha256: one hash that
    covers every file of the package. Champion pointers and train results record it."""
    try:
        return hashlib.sha256((package_dir / "model.json").read_bytes()).hexdigest()
    except FileNotFoundError:
        raise CheckpointError(f"model package {package_dir} has no model.json") from None


def _package_meta(package_dir: Path, expected_sha256: str | None = None) -> PackageMeta:
    if expected_sha256 is not None and meta_sha256(package_dir) != expected_sha256:
        raise CheckpointError(f"model package {package_dir}: model.json does not match the sha256 recorded for it "
                              "(corrupted or replaced)")
    return PackageMeta.read(package_dir)


def package_stats(package_dir: Path) -> FeatureStats:
    """A package's feature statistics, without loading its weights."""
    return _package_meta(package_dir).stats()


def load_package(
    package_dir: Path, trusted_factory: str | None, expected_meta_sha256: str | None = None
) -> tuple[torch.nn.Module, FeatureStats, PackageMeta]:
    """A verified package's model in eval mode.

    `trusted_factory` is the running config's `model.factory`: a package read back from storage
    may only name that one (or none, the built-in MLP), because importing a name found in the
    root would let anyone who can write the root run code here."""
    meta = _package_meta(package_dir, expected_meta_sha256)
    config = meta.model()
    if config.factory is not None and config.factory != trusted_factory:
        raise UntrustedFactory(f"model package {package_dir} names model.factory '{config.factory}', which is not "
                               "this run's model.factory; a factory named by storage is never imported")
    stats = meta.stats()
    model = build_model(config, ModelSchema.of(stats))
    try:
        state = torch.load(package_dir / "model.pt", map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001
        raise CheckpointError(f"model package {package_dir}: cannot load model.pt ({err})") from None
    if weights_sha256(state) != meta.sha256:
        raise CheckpointError(f"model package {package_dir}: weights do not match their sha256 (corrupted)")
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise CheckpointError(f"model package {package_dir}: weights do not fit its model config ({err})") from None
    model.eval()
    return model, stats, meta


def export_model_package(out_dir: Path, state_dict: dict[str, torch.Tensor], config: RetrainConfig,
                         stats: FeatureStats, run_key: str, best_step: int | None, metric: str,
                         value: float | None) -> ModelRef:
    """A self-contained model: weights plus everything needed to score new data."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sha = weights_sha256(state_dict)
    tmp = out_dir / f".model.pt.tmp-{os.getpid()}"
    torch.save(state_dict, tmp)
    os.replace(tmp, out_dir / "model.pt")
    meta = PackageMeta(sha256=sha, run_key=run_key, best_step=best_step, val_auc=value if metric == "auc" else None,
                       val_metric=ValMetric(name=metric, value=value),
                       architecture=config.model.model_dump(mode="json"),
                       feature_stats=json.loads(stats.to_json()), tags=dict(config.cost.tags))
    write_json_atomic(out_dir / "model.json", meta.model_dump(mode="json", by_alias=True))
    return ModelRef(uri=str(out_dir / "model.pt"), sha256=sha, meta_sha256=meta_sha256(out_dir))


def load_warm_start(model: torch.nn.Module, weights: Path, sha256: str | None,
                    champion_classes: list[Any] | None = None, classes: list[Any] | None = None) -> None:
    """Load a champion's weights into `model`, refusing weights that do not match their hash.
    `champion_classes` and `classes`: a multiclass champion's classes and this model's, where
    this dataset added some (`_grown_head`)."""
    try:
        state = torch.load(weights, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file is the same user-facing problem
        raise CheckpointError(f"warm start: cannot load {weights} ({err})") from None
    if sha256 is not None and weights_sha256(state) != sha256:
        raise CheckpointError(f"warm start: {weights} does not match the champion's sha256 (corrupted)")
    target = model.state_dict()
    state = _grown_embeddings(state, target)
    if champion_classes is not None and classes is not None and champion_classes != classes:
        state = _grown_head(state, champion_classes, classes)
    model.load_state_dict(state)
    log.info("warm start from %s", weights)


def _grown_head(state: dict[str, torch.Tensor], champion_classes: list[Any],
                classes: list[Any]) -> dict[str, torch.Tensor]:
    """The champion's output layer for a model whose classes grew. Each class the champion knew
    keeps its row, moved to that class's index (a dataset's classes are sorted, so a new class
    shifts those after it). A new class's row starts at zero weights and a bias of the
    log-mean-exp of the champion's biases: before training, on rows where the champion's logits
    sit near their biases, it gets about a class's share of the probability, and the ratios
    between the old classes' probabilities (so their ranking) are exactly the champion's."""
    weight, bias = state.get("head.weight"), state.get("head.bias")
    if weight is None or bias is None or weight.shape[0] != len(champion_classes):
        raise CheckpointError("warm start: the champion's output layer does not match its classes")
    at = {c: i for i, c in enumerate(champion_classes)}
    start = torch.logsumexp(bias, 0) - math.log(len(champion_classes))
    rows, biases = [], []
    for c in classes:
        i = at.get(c)
        rows.append(weight[i] if i is not None else torch.zeros_like(weight[0]))
        biases.append(bias[i] if i is not None else start)
    return {**state, "head.weight": torch.stack(rows), "head.bias": torch.stack(biases)}


def _grown_embeddings(state: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The champion's weights for a model whose categorical vocabularies grew: a grown
    embedding table keeps the champion's rows, and each new category's row starts as a copy of
    row 0, the unknown category's. The warm-started model then scores every row exactly as the
    champion did (a new category was unknown to it), and training moves the new rows apart."""
    out = dict(state)
    for name, tensor in state.items():
        wanted = target.get(name)
        if (wanted is not None and name.startswith("embeddings.") and tensor.dim() == 2
                and wanted.shape[1:] == tensor.shape[1:] and wanted.shape[0] > tensor.shape[0]):
            fresh = tensor[:1].expand(wanted.shape[0] - tensor.shape[0], -1)
            out[name] = torch.cat([tensor, fresh])
    return out
