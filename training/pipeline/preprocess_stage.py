"""The preprocess stage: feature statistics of a dataset's train split (vocabularies, scaling,
a text tokenizer, image sizes), content-addressed and reused, on any machine, once they verify
against their sha256."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from training.config import PreprocessConfig, StorageConfig
from training.data.manifest import DatasetManifest, require_manifest
from training.data.prepare.features import (
    PREPROCESS_VERSION,
    FeatureStats,
    derived_rels,
    fit_feature_stats,
    preprocess_key,
    verified_feature_stats,
)
from training.pipeline.handoffs import PrepResult
from training.storage.root import CACHE, StorageRoot

log = logging.getLogger(__name__)


def preprocess_stage(dataset_dir: str, config: PreprocessConfig, storage: StorageConfig,
                     tags: dict[str, str] | None = None) -> PrepResult:
    t0 = time.perf_counter()
    root = StorageRoot(storage, tags)
    found = fitted_before(Path(dataset_dir), config, root, t0)
    if found is not None:
        return found
    manifest = require_manifest(Path(dataset_dir))
    rel, check_rel, derived = _rels(manifest, config)
    stats_path, stats = fit_feature_stats(Path(dataset_dir), manifest, config, root.path("preprocess"))
    # The derived arrays' index, then the statistics, then their checksum: each marks what
    # precedes it complete.
    root.publish_all([*derived, rel, check_rel], CACHE)
    return _result(stats_path, rel, stats, reused=False, t0=t0)


def fitted_before(dataset_dir: Path, config: PreprocessConfig, root: StorageRoot, t0: float) -> PrepResult | None:
    """The statistics fitted before, on any machine, that still match their checksum (with their
    token ids and pixels, fetched here); None when they must be fitted. Reads, never writes, the
    root: a node of a multi-node run reads the statistics the train task's flow fitted."""
    manifest = require_manifest(dataset_dir)
    rel, check_rel, derived = _rels(manifest, config)
    root.fetch(rel)
    root.fetch(check_rel)
    existing = verified_feature_stats(root.path(rel))
    if existing is None:
        return None
    if derived:
        if root.fetch(derived[-1]) is None:
            return None
        for derived_rel in derived[:-1]:  # token ids and pixels: fetched whole, checked as they load
            root.fetch(derived_rel)
    return _result(root.path(rel), rel, existing, reused=True, t0=t0)  # verified once, not again inside the fit


def _rels(manifest: DatasetManifest, config: PreprocessConfig) -> tuple[str, str, list[str]]:
    """(statistics, their checksum, the derived arrays) under the root, by content."""
    key = preprocess_key(manifest.fingerprint, config, bool(manifest.text), manifest.task == "regression",
                         bool(manifest.image))
    rel_dir = f"preprocess/{key}"
    rel = f"{rel_dir}/feature_stats.json"
    return rel, f"{rel}.sha256", derived_rels(rel_dir, manifest) if manifest.text or manifest.image else []


def _result(stats_path: Path, rel: str, stats: FeatureStats, reused: bool, t0: float) -> PrepResult:
    return PrepResult(stats_path=str(stats_path), stats_rel=rel, reused=reused, key=stats.key,
                      code_version=PREPROCESS_VERSION, cardinalities=stats.cardinalities,
                      target_transform=stats.target_transform if stats.task == "regression" else None,
                      seconds=time.perf_counter() - t0)
