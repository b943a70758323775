"""`model`: the network's widths, embeddings, encoders, or the user's `model.factory`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from training.config.marks import COMPUTED, COMPUTED_SINCE, OPERATIONAL, computed_before
from training.config.section import _Section

__all__ = ["ModelConfig"]


class ModelConfig(_Section):
    factory: str | None = Field(
        None,
        description='User model as "package.module:function" called with (schema, config) (the deprecated form '
        "(n_numeric, cardinalities, config) still works), or as \"package.module:name\" of a "
        "training.model.spec.TrainSpec that also builds the optimizer and the learning-rate schedule; empty: the "
        "built-in model.", json_schema_extra=COMPUTED
    )
    hidden: list[int] = Field([128, 64], description="Hidden layer widths of the MLP.", json_schema_extra=COMPUTED)
    embedding_dim: int = Field(16, gt=0, description="Embedding width per categorical column.", json_schema_extra=COMPUTED)
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout after each hidden layer.", json_schema_extra=COMPUTED)
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory: "
                                         "every other MLP block, and every transformer block.", json_schema_extra=OPERATIONAL)
    text_dim: int = Field(128, gt=0, description="data.text: width of the transformer encoder.", json_schema_extra=COMPUTED_SINCE)
    text_layers: int = Field(2, ge=1, description="data.text: pre-norm transformer blocks.", json_schema_extra=COMPUTED_SINCE)
    text_heads: int = Field(4, ge=1, description="data.text: attention heads (text_dim must divide by it).",
                            json_schema_extra=COMPUTED_SINCE)
    image_channels: list[int] = Field([32, 64], description="data.image: channels of each "
                                      "conv block of the CNN (each block halves the resolution).",
                                      json_schema_extra=COMPUTED_SINCE)
    numeric_embedding: Literal["none", "periodic", "piecewise"] = Field(
        "piecewise", description="How numeric columns enter the MLP: none, as standardised values; periodic, each "
        "through learned sin/cos features and a linear layer with ReLU; piecewise, each through its piecewise-linear "
        "encoding over preprocess.numeric_bins quantile bins of the train split and a linear layer (both from Gorishniy "
        "et al., \"On Embeddings for Numerical Features in Tabular Deep Learning\", 2022, through "
        "rtdl-num-embeddings; piecewise is the paper's version B, which starts as a linear embedding).",
        json_schema_extra=computed_before("none"))
    numeric_embedding_dim: int = Field(24, gt=0, description="model.numeric_embedding: periodic or piecewise: the "
                                       "width of each numeric column's embedding.", json_schema_extra=COMPUTED_SINCE)
    numeric_frequency_scale: float = Field(
        0.01, gt=0, description="model.numeric_embedding: periodic: the standard deviation of the initial frequencies "
        "(the paper's sigma, its most sensitive setting; a search space can tune it).", json_schema_extra=COMPUTED_SINCE)
    attention: Literal["auto", "math", "flash", "efficient", "cudnn"] = Field(
        "auto", description="Attention kernel of torch's scaled_dot_product_attention: auto lets torch choose (flash "
        "or memory-efficient on a GPU); the others force one, and one the device lacks is a config error.",
        json_schema_extra=OPERATIONAL)

    @field_validator("hidden")
    @classmethod
    def _positive_widths(cls, v: list[int]) -> list[int]:
        if any(w <= 0 for w in v):
            raise ValueError(f"every hidden width must be > 0 (got {v})")
        return v

    @field_validator("image_channels")
    @classmethod
    def _positive_channels(cls, v: list[int]) -> list[int]:
        if not v or any(w <= 0 for w in v):
            raise ValueError(f"needs at least one block, each with > 0 channels (got {v})")
        return v

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.text_dim % self.text_heads:
            raise ValueError(f"text_dim ({self.text_dim}) must be a multiple of text_heads ({self.text_heads})")
        return self

    @field_validator("factory")
    @classmethod
    def _factory_form(cls, v: str | None) -> str | None:
        if v is not None and (v.count(":") != 1 or not all(v.split(":"))):
            raise ValueError(f'must look like "package.module:function" (got {v!r})')
        return v
