from __future__ import annotations

from typing import Any

from prefect import task

from training.data.features import PREPROCESS_VERSION
from training.stages import preprocess_stage

__all__ = ["fit_features", "PREPROCESS_VERSION"]


@task(name="preprocess", persist_result=True)
def fit_features(
    dataset_dir: str, dataset_fingerprint: str, preprocess: dict[str, Any], code_version: str, storage_root: str
) -> dict[str, Any]:
    """Fit feature statistics on the train split. Cached across flow runs on
    (dataset fingerprint, preprocessing config, code version, storage root)."""
    return preprocess_stage(dataset_dir, preprocess, storage_root)
