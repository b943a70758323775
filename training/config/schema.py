"""The run configuration's schema: one pydantic model (`RetrainConfig`) of sections, each field
with its type, default, description and fingerprint mark. Loading it from YAML and overrides is
`training.config.loading`; the marks and fingerprints are `training.config.marks`."""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, model_validator

from training.config.billing import BudgetConfig, CostConfig
from training.config.data import DataConfig, PreprocessConfig
from training.config.evaluation import EvalConfig
from training.config.marks import COMPUTED, OPERATIONAL
from training.config.model import ModelConfig
from training.config.problems import format_errors
from training.config.section import TASK_METRICS, _Section
from training.config.space import check_space
from training.config.storage import StorageConfig
from training.config.train import TrainConfig
from training.config.tune import TrackingConfig, TuneConfig
from training.errors import ConfigError
from training.copies import updated

__all__ = ["RetrainConfig"]


class RetrainConfig(_Section):
    """Everything that defines a retraining run."""

    data: DataConfig = Field(default_factory=DataConfig, json_schema_extra=COMPUTED,
                             description="The source data: where it is, the label, the feature columns, splits and packing.")
    preprocess: PreprocessConfig = Field(default_factory=PreprocessConfig, json_schema_extra=COMPUTED,
                                         description="Feature statistics and encodings fitted on the train split (cached).")
    model: ModelConfig = Field(default_factory=ModelConfig, json_schema_extra=COMPUTED,
                               description="The network: widths, embeddings, dropout, or your own model.factory.")
    train: TrainConfig = Field(default_factory=TrainConfig, json_schema_extra=COMPUTED,
                               description="Training: steps, batch, validation, early stopping, precision, device.")
    eval: EvalConfig = Field(default_factory=EvalConfig, json_schema_extra=OPERATIONAL,
                             description="Evaluation and the champion/challenger gate: the metric, the target, the margin.")
    storage: StorageConfig = Field(default_factory=StorageConfig, json_schema_extra=OPERATIONAL,
                                   description="The storage root (a folder or s3://) and what it keeps.")
    cost: CostConfig = Field(default_factory=CostConfig, json_schema_extra=OPERATIONAL,
                             description="What the machine costs: its instance type, market, prices and cost tags.")
    budget: BudgetConfig = Field(default_factory=BudgetConfig, json_schema_extra=OPERATIONAL,
                                 description="Spending limits that stop a run gracefully: dollars, GPU-hours, seconds.")
    tune: TuneConfig = Field(default_factory=TuneConfig, json_schema_extra=OPERATIONAL,
                             description="Hyperparameter search (retrain tune): the space, the pruner, the budget.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, json_schema_extra=OPERATIONAL,
                                     description="MLflow tracking and the model registry (optional).")

    @model_validator(mode="after")
    def _metric_of_task(self) -> RetrainConfig:
        metric, task = self.eval.metric, self.data.task
        if metric is not None and metric not in TASK_METRICS[task]:
            raise ValueError(f"eval.metric {metric!r} is not a {task} metric; use one of {list(TASK_METRICS[task])}")
        if self.eval.target_auc is not None and (task != "binary" or self.eval.metric not in (None, "auc")):
            raise ValueError("eval.target_auc is the target of the binary auc metric; set eval.target instead")
        if self.tune.space:
            check_space(self)
        return self

    def for_train_rows(self, rows: int) -> RetrainConfig:
        """This config with its data-dependent `auto` settings resolved for a train split of `rows` rows."""
        return updated(self, {"train": self.train.for_train_rows(rows)})

    def with_values(self, values: dict[str, Any], origin: str) -> RetrainConfig:
        """This config with each dotted key of `values` set (e.g. a tuning trial's parameters),
        validated; `origin` names where the values come from in an error."""
        raw = {**self.raw_with(values), "tune": self.tune.model_dump(mode="json")}
        try:
            return type(self).model_validate(raw)
        except ValidationError as err:
            raise ConfigError(format_errors(err, origin, type(self))) from None

    def value_at(self, key: str) -> Any:
        """The JSON value of a dotted key (e.g. `train.optim.lr`), as `with_values` would set it."""
        node: Any = self.model_dump(mode="json", exclude={"tune"})
        for part in key.split("."):
            node = node[part]
        return node

    def raw_with(self, values: dict[str, Any]) -> dict[str, Any]:
        """This config as JSON, without its tune section, with each dotted key of `values` set."""
        raw = self.model_dump(mode="json", exclude={"tune"})
        for key, value in values.items():
            *path, name = key.split(".")
            node = raw
            for part in path:
                node = node[part]
            node[name] = value
        return raw
