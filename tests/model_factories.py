"""User-model factories for tests (imported by the training child through model.factory)."""

from __future__ import annotations

import torch
from torch import nn


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
