"""The parts a run is built from, swappable as one typed spec, as torchtitan's
`protocols/train_spec.py` names them: the model, its optimizer and its learning-rate schedule.
The loss and the predictions follow the label's task (`training.model.objectives.TASKS`).

`model.factory` stays the user's way in. It names a function that builds the model (trained
with the built-in optimizer and schedule), or a `TrainSpec` that builds all three:

    # mypkg/specs.py
    def sgd(model, train_config, fused):
        return torch.optim.SGD(model.parameters(), lr=train_config.peak_lr(), momentum=0.9)

    spec = TrainSpec("columns-sgd", build_optimizer=sgd)   # model.factory: "mypkg.specs:spec"

A spec is code, so it is trusted as a factory is: named by the config, never by storage.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from training.config import ModelConfig, TrainConfig
from training.errors import ConfigError
from training.model.network import ColumnsNet, ModelSchema, factory_model, load_factory

__all__ = ["BUILT_IN", "ModelBuilder", "OptimizerBuilder", "SchedulerBuilder", "TrainSpec", "adamw", "build_model",
           "columns_model", "lr_lambda", "train_spec", "warmup_cosine"]

ModelBuilder = Callable[[ModelConfig, ModelSchema], nn.Module]
# (the model, train.*, whether the fused kernel is available on this device) -> its optimizer
OptimizerBuilder = Callable[[nn.Module, TrainConfig, bool], torch.optim.Optimizer]
SchedulerBuilder = Callable[[torch.optim.Optimizer, TrainConfig], torch.optim.lr_scheduler.LRScheduler]


def columns_model(config: ModelConfig, schema: ModelSchema) -> nn.Module:
    """The built-in model (`training.model.network.ColumnsNet`)."""
    return ColumnsNet(schema, config.hidden, config.embedding_dim, config.dropout, config.gradient_checkpointing,
                      config)


def adamw(model: nn.Module, tc: TrainConfig, fused: bool) -> torch.optim.Optimizer:
    """AdamW at train.optim's peak learning rate and weight decay. A resumed run keeps the
    implementation its checkpoint's param_groups name, so its numerics do not change mid-run."""
    return torch.optim.AdamW(model.parameters(), lr=tc.peak_lr(), weight_decay=tc.optim.weight_decay,
                             fused=fused or None)


def lr_lambda(warmup: int, total: int) -> Callable[[int], float]:
    """Linear warm-up, then cosine down to 10% of the peak learning rate at `total`."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def warmup_cosine(optimizer: torch.optim.Optimizer, tc: TrainConfig) -> torch.optim.lr_scheduler.LRScheduler:
    """train.schedule's warm-up, then the cosine (`lr_lambda`) over the run's steps."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(tc.schedule.warmup_steps, tc.max_steps))


@dataclass(frozen=True)
class TrainSpec:
    """One way to build a run's model, optimizer and schedule; each part defaults to the
    built-in one, so a spec names only what it swaps."""

    name: str
    build_model: ModelBuilder = columns_model
    build_optimizer: OptimizerBuilder = adamw
    build_scheduler: SchedulerBuilder = warmup_cosine


BUILT_IN = TrainSpec("columns")


def train_spec(config: ModelConfig) -> TrainSpec:
    """The spec `model.factory` names: the built-in one when it is empty, a `TrainSpec` it
    names, or the built-in optimizer and schedule around the model a factory function builds."""
    if config.factory is None:
        return BUILT_IN
    found = load_factory(config.factory)
    if isinstance(found, TrainSpec):
        return found
    if callable(found):
        return TrainSpec(config.factory, build_model=functools.partial(factory_model, found))
    raise ConfigError(f"model.factory: '{config.factory}' is a {type(found).__name__}, not a function that builds "
                      "the model nor a training.model.spec.TrainSpec")


def build_model(config: ModelConfig, schema: ModelSchema) -> nn.Module:
    """The model of `config`, as its spec builds it."""
    return train_spec(config).build_model(config, schema)
