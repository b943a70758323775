"""The validated run configuration.

One pydantic model (`RetrainConfig`) is the whole contract: the CLI builds it from YAML plus
`--set` overrides, and the Prefect flow takes it as its single parameter, so the UI renders a
form from the same field descriptions. Unknown keys are errors, and every problem is reported
at once in a single `ConfigError`.

    schema.py    the whole config (`RetrainConfig`), of one section per module, each field with
                 its type, default, description and mark: data.py (data, preprocess), model.py,
                 train.py, evaluation.py (eval), billing.py (cost, budget), storage.py, tune.py
                 (tune, tracking); section.py is their base and the task metrics
    marks.py     what each field means to a run's content address; fingerprints
    loading.py   YAML and overrides, validation, a deployment's parameters merged under a run's
    problems.py  a failed validation as one line, with the nearest known key
    space.py     tune.space checked against the schema
    legacy.py    keys of earlier versions and where they live now
    prices.py    the shipped price table, cost.prices' default

The names below are the package's interface; its modules are its rooms.
"""

from training.config.loading import apply_overrides, load_config, merge_over, validate_config
from training.config.marks import (COMPUTED, COMPUTED_SINCE, FLAT_COMPUTED, OPERATIONAL, computed_before,
                                   fingerprint, fingerprinted, is_computed)
from training.config.billing import BudgetConfig, CostConfig, InstancePrice
from training.config.data import DATE_PARTS, DataConfig, PreprocessConfig, WindowConfig, date_part
from training.config.evaluation import EvalConfig
from training.config.model import ModelConfig
from training.config.schema import RetrainConfig
from training.config.section import DEMO_CATEGORICAL, DEMO_NUMERIC, TASK_METRICS, _Section, metric_name
from training.config.storage import LifecycleConfig, StorageConfig
from training.config.train import TrainConfig
from training.config.tune import MAX_TUNE_SEEDS, TrackingConfig, TuneConfig

__all__ = [
    "COMPUTED", "COMPUTED_SINCE", "FLAT_COMPUTED", "OPERATIONAL", "computed_before", "fingerprint", "fingerprinted",
    "is_computed",
    "DEMO_CATEGORICAL", "DEMO_NUMERIC", "MAX_TUNE_SEEDS", "TASK_METRICS", "metric_name",
    "BudgetConfig", "CostConfig", "DataConfig", "EvalConfig", "InstancePrice", "LifecycleConfig", "ModelConfig",
    "PreprocessConfig", "RetrainConfig", "StorageConfig", "TrackingConfig", "TrainConfig", "TuneConfig",
    "WindowConfig", "_Section", "DATE_PARTS", "date_part",
    "apply_overrides", "load_config", "merge_over", "validate_config",
]
