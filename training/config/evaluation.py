"""`eval`: the metric, the target and the champion/challenger gate."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from training.config.marks import COMPUTED_SINCE, OPERATIONAL
from training.config.section import _Section

__all__ = ["EvalConfig"]


class EvalConfig(_Section):
    metric: str | None = Field(
        None, description="Metric for early stopping, the champion gate and promotion: auc, logloss or accuracy "
        "(binary), accuracy, macro_f1 or logloss (multiclass), rmse, mae or r2 (regression). Empty: auc, accuracy "
        "or rmse by data.task. Lower is better for logloss, rmse and mae.", json_schema_extra=COMPUTED_SINCE)
    target: float | None = Field(None, description="Test value of eval.metric a model must reach to be promoted "
                                 "(at least it, or at most it for a lower-is-better metric).", json_schema_extra=OPERATIONAL)
    target_auc: float | None = Field(None, gt=0, le=1, description="Old name of eval.target for the auc metric; still read.", json_schema_extra=OPERATIONAL)
    min_delta: float = Field(0.0, ge=0, description="Test improvement of eval.metric the challenger needs over the champion.", json_schema_extra=OPERATIONAL)
    promote_on: Literal["interval", "point"] = Field(
        "interval", description="interval: promote only when the lower bound of the improvement's confidence "
        "interval (both models on the same test rows: DeLong for auc, a paired bootstrap otherwise) clears "
        "eval.min_delta, so noise never wins; point: when the improvement itself does.", json_schema_extra=OPERATIONAL)
    confidence: float = Field(0.95, gt=0, lt=1, description="Confidence level of the improvement's interval "
                              "(eval.promote_on: interval).", json_schema_extra=OPERATIONAL)

    @model_validator(mode="after")
    def _one_target(self) -> EvalConfig:
        if self.target is not None and self.target_auc is not None and self.target != self.target_auc:
            raise ValueError("eval.target and its old name eval.target_auc disagree: set only eval.target")
        return self

    def target_value(self) -> float | None:
        """eval.target, or the old eval.target_auc."""
        return self.target if self.target is not None else self.target_auc
