"""User-model factories and train specs for tests (imported by the training child through model.factory)."""

from __future__ import annotations

import torch
from torch import nn

from training.config import TrainConfig
from training.model.network import ModelSchema
from training.model.spec import TrainSpec


class _WrongShape(nn.Module):
    def __init__(self, n_numeric: int) -> None:
        super().__init__()
        self.linear = nn.Linear(n_numeric, 3)

    def forward(self, x_num: torch.Tensor, x_cat: torch.Tensor) -> torch.Tensor:
        return self.linear(x_num)  # (B, 3): does not match the (B,) labels


def wrong_shape(n_numeric: int, cardinalities: list[int], config: object) -> nn.Module:
    return _WrongShape(n_numeric)


class Linear(nn.Module):
    def __init__(self, n_numeric: int) -> None:
        super().__init__()
        self.linear = nn.Linear(n_numeric, 1)

    def forward(self, x_num: torch.Tensor, x_cat: torch.Tensor) -> torch.Tensor:
        return self.linear(x_num).squeeze(-1)


def linear(n_numeric: int, cardinalities: list[int], config: object) -> nn.Module:
    return Linear(n_numeric)


class SchemaLinear(nn.Module):
    """The current form: built from the schema, called with the whole batch."""

    def __init__(self, schema: ModelSchema) -> None:
        super().__init__()
        width = len(schema.numeric) + sum(schema.vector_dims)
        self.linear = nn.Linear(width, schema.n_outputs)
        self.vectors = bool(schema.vector)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x = torch.cat([batch["num"], batch["vec"]], 1) if self.vectors else batch["num"]
        out = self.linear(x)
        return out.squeeze(-1) if out.shape[-1] == 1 else out


def schema_linear(schema: ModelSchema, config: object) -> nn.Module:
    return SchemaLinear(schema)


def raises(schema: ModelSchema, config: object) -> nn.Module:
    """A factory with a bug of the user's: it raises while building."""
    raise ValueError("no such layer: 'Linaer'")


def _sgd(model: nn.Module, train_config: TrainConfig, fused: bool) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=train_config.peak_lr(), momentum=0.9)


def _constant(optimizer: torch.optim.Optimizer, train_config: TrainConfig) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0)


# A spec that swaps every part: its own model, SGD with momentum, and a constant learning rate.
sgd_spec = TrainSpec("schema-linear-sgd", build_model=lambda config, schema: SchemaLinear(schema),
                     build_optimizer=_sgd, build_scheduler=_constant)

not_a_model = 42  # named by model.factory: neither a function nor a TrainSpec
