from __future__ import annotations

from typing import Any

from prefect import task

from training.data.features import PREPROCESS_VERSION
from training.stages import preprocess_stage

__all__ = ["fit_features", "PREPROCESS_VERSION"]


@task(name="preprocess", persist_result=True)
def fit_features(
    dataset_dir: str,
    dataset_fingerprint: str,
    preprocess: dict[str, Any],
    code_version: str,
    storage_root: str,
    storage: dict[str, Any] | None = None,
    tags: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Fit feature statistics on the train split. Cached across flow runs, and machines, on
    (dataset fingerprint, preprocessing config, code version, storage root): the local
    `dataset_dir` and the connection settings in `storage` are not part of the key."""
    return preprocess_stage(dataset_dir, preprocess, storage_root, storage, tags)
