"""What scoring hands back, torch-free: the flow's process and the CLI read it without the
model's imports."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["PredictResult"]


class PredictResult(BaseModel):
    """What `retrain predict` wrote (or found already written)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    output: str
    rows: int
    model_sha256: str
    skipped: bool  # the output already held this model's scores of this input
    seconds: float
    key_columns: list[str]  # not `keys`: Prefect treats a model with .keys() as a mapping
    torch_threads: int | None = None  # the model's intra-op threads, when the stage chose them
