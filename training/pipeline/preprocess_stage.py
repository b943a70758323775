"""The preprocess stage: feature statistics of a dataset's train split (vocabularies, scaling,
a text tokenizer, image sizes), content-addressed and reused, on any machine, once they verify
against their sha256."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.config import PreprocessConfig, StorageConfig
from training.data.features import (
    PREPROCESS_VERSION,
    derived_rels,
    fit_feature_stats,
    preprocess_key,
    verified_feature_stats,
)
from training.data.manifest import require_manifest
from training.pipeline.handoffs import PrepResult
from training.storage.root import CACHE, StorageRoot

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


def preprocess_stage(
    dataset_dir: str,
    preprocess: dict[str, Any],
    storage_root: str,
    storage: dict[str, Any] | None = None,
    tags: dict[str, str] | None = None,
) -> PrepResult:
    t0 = time.perf_counter()
    config = PreprocessConfig.model_validate(preprocess)
    manifest = require_manifest(Path(dataset_dir))
    root = StorageRoot(StorageConfig.model_validate(storage or {"root": storage_root}), tags)
    key = preprocess_key(manifest.fingerprint, config, bool(manifest.text), manifest.task == "regression",
                         bool(manifest.image))
    rel_dir = f"preprocess/{key}"
    rel = f"{rel_dir}/feature_stats.json"
    check_rel = f"{rel}.sha256"
    # Fitted before, on any machine, and still matching its checksum: reuse it.
    root.fetch(rel)
    root.fetch(check_rel)
    existing = verified_feature_stats(root.path(rel))
    derived = derived_rels(rel_dir, manifest) if manifest.text or manifest.image else []
    if existing is not None and derived and root.fetch(derived[-1]) is not None:
        for derived_rel in derived[:-1]:  # token ids and pixels: fetched whole, checked as they load
            root.fetch(derived_rel)
    reused = existing is not None and (not derived or root.path(derived[-1]).exists())
    if existing is not None and reused:
        stats_path, stats = root.path(rel), existing  # verified once, not again inside the fit
    else:
        stats_path, stats = fit_feature_stats(Path(dataset_dir), manifest, config, root.path("preprocess"))
    if not reused:
        # The derived arrays' index, then the statistics, then their checksum: each marks what
        # precedes it complete.
        root.publish_all([*derived, rel, check_rel], CACHE)
    return PrepResult(stats_path=str(stats_path), stats_rel=rel, reused=reused, key=stats.key,
                      code_version=PREPROCESS_VERSION, cardinalities=stats.cardinalities,
                      target_transform=stats.target_transform if stats.task == "regression" else None,
                      seconds=time.perf_counter() - t0)

