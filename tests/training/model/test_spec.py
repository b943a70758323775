"""A TrainSpec named by model.factory builds the run's model, optimizer and schedule; its run
resumes bit-identically and its package loads back with the same spec."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.training.helpers import assert_resumes_bit_identically, make_job
from training.config import RetrainConfig, load_config
from training.data.manifest import require_manifest
from training.errors import ConfigError
from training.model.evaluation import evaluate_package
from training.model.spec import BUILT_IN, TrainSpec, train_spec
from training.trainer.checkpoint import latest_verified_state
from training.trainer.run import train

SPEC = "tests.model_factories:sgd_spec"


def _config(small_config: RetrainConfig, factory: str) -> RetrainConfig:
    raw = small_config.model_dump(mode="json")
    return load_config(overrides=[f"storage.root={raw['storage']['root']}", f"data.source={raw['data']['source']}",
                                  "data.rows_per_member=256", "data.shard_size_mb=0.06", "train.batch_size=128",
                                  "train.eval_every=20", "train.checkpoint.every=20", "train.max_steps=60",
                                  "train.loader.num_workers=0", f"model.factory={factory}"])


def test_the_factory_names_the_spec_and_a_function_or_nothing_keeps_the_built_in_optimizer(
        small_config: RetrainConfig) -> None:
    assert train_spec(small_config.model) is BUILT_IN
    spec = train_spec(_config(small_config, SPEC).model)
    assert isinstance(spec, TrainSpec) and spec.name == "schema-linear-sgd"
    wrapped = train_spec(_config(small_config, "tests.model_factories:schema_linear").model)
    assert wrapped.build_optimizer is BUILT_IN.build_optimizer and wrapped.build_scheduler is BUILT_IN.build_scheduler


def test_a_factory_that_names_neither_a_function_nor_a_spec_is_one_line(small_config: RetrainConfig) -> None:
    with pytest.raises(ConfigError, match="'tests.model_factories:not_a_model' is a int, not a function"):
        train_spec(_config(small_config, "tests.model_factories:not_a_model").model)


def test_a_spec_trains_with_its_own_optimizer_and_schedule_and_loads_back(small_config: RetrainConfig) -> None:
    config = _config(small_config, SPEC)
    job = make_job(config)
    result = train(job)
    found = latest_verified_state(Path(job.run_dir) / "checkpoints")
    assert found is not None
    optimizer = found[2]["optimizer"]
    # SGD's state (a momentum buffer per parameter), at the peak learning rate to the end.
    assert all(set(s) == {"momentum_buffer"} for s in optimizer["state"].values())
    assert [g["lr"] for g in optimizer["param_groups"]] == [pytest.approx(config.train.peak_lr())]
    scored = evaluate_package(Path(job.run_dir) / "model", Path(job.dataset_dir),
                              require_manifest(Path(job.dataset_dir)), SPEC)
    assert result.steps == 60 and 0.5 < scored["auc"] <= 1.0


def test_a_spec_run_resumes_bit_identically(small_config: RetrainConfig) -> None:
    assert_resumes_bit_identically(_config(small_config, SPEC), stop_at=20)


def test_the_built_in_spec_is_adamw_with_a_warm_up(small_config: RetrainConfig) -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = BUILT_IN.build_optimizer(model, small_config.train, False)
    scheduler = BUILT_IN.build_scheduler(optimizer, small_config.train)
    assert isinstance(optimizer, torch.optim.AdamW) and isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR)
