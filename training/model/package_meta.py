"""model.json, the description beside a package's weights, read without importing torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from training.config import ModelConfig
from training.data.prepare.features import FeatureStats
from training.errors import CheckpointError
from training.storage.files import read_json

__all__ = ["PackageMeta", "ValMetric"]


class ValMetric(BaseModel):
    name: str
    value: float | None


class PackageMeta(BaseModel):
    """model.json. The model config and the statistics stay the JSON they were written as, so the
    file (and the sha256 that champion pointers record for it) reads back byte for byte."""

    model_config = ConfigDict(populate_by_name=True, protected_namespaces=())

    sha256: str
    run_key: str
    best_step: int | None
    val_auc: float | None
    val_metric: ValMetric
    architecture: dict[str, Any] = Field(alias="model_config")
    feature_stats: dict[str, Any]
    tags: dict[str, str] = {}

    def model(self) -> ModelConfig:
        # A package written before model.numeric_embedding existed took its numerics as they are.
        return ModelConfig(**{"numeric_embedding": "none", **self.architecture})

    def stats(self) -> FeatureStats:
        return FeatureStats(**self.feature_stats)

    @classmethod
    def read(cls, package_dir: Path) -> PackageMeta:
        raw = read_json(package_dir / "model.json")
        if raw is None:
            raise CheckpointError(f"model package {package_dir} has no model.json")
        try:
            return cls.model_validate(raw)
        except ValidationError as err:
            raise CheckpointError(f"model package {package_dir}: model.json is not a package's "
                                  f"({err.errors()[0]['msg']})") from None
