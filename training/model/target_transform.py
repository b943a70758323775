"""A regression label's transform in torch (fitted by `training.data.prepare.target`): the training
loss's target, and the exact inverse that evaluation, `retrain predict` and the portable export
apply to the model's output. An `nn.Module` so that torch.export carries the quantile knots."""

from __future__ import annotations

import torch
from torch import nn

from training.data.prepare.features import FeatureStats
from training.data.prepare.target import P_BOUND

__all__ = ["LabelTransform"]


def _interp(x: torch.Tensor, xp: torch.Tensor, fp: torch.Tensor) -> torch.Tensor:
    """numpy.interp for increasing `xp` (repeats allowed: the last of equal knots wins)."""
    x = x.clamp(xp[0], xp[-1])
    hi = torch.searchsorted(xp, x.contiguous(), right=True).clamp(1, xp.numel() - 1)
    x0, x1, f0, f1 = xp[hi - 1], xp[hi], fp[hi - 1], fp[hi]
    width = x1 - x0
    w = torch.where(width > 0, (x - x0) / torch.where(width > 0, width, torch.ones_like(width)), torch.ones_like(x))
    return f0 + w * (f1 - f0)


class LabelTransform(nn.Module):
    """(g(y) - mean) / std for training, and its inverse for predictions in the label's units."""

    knots: torch.Tensor
    levels: torch.Tensor

    def __init__(self, stats: FeatureStats) -> None:
        super().__init__()
        self.kind = stats.target_transform
        self.mean, self.std = float(stats.label_mean), float(stats.label_std)
        knots = torch.tensor(stats.target_knots or [0.0, 1.0], dtype=torch.float64)
        self.register_buffer("knots", knots)
        self.register_buffer("levels", torch.linspace(0.0, 1.0, knots.numel(), dtype=torch.float64))

    def target(self, y: torch.Tensor) -> torch.Tensor:
        """The standardised transformed label the model learns (fp32, as the loss takes it)."""
        if self.kind == "standardize":
            return (y - self.mean) / self.std
        y64 = y.double()
        if self.kind == "log1p":
            g = torch.log1p(y64)
        else:
            # The task holds this module outside the model, so `model.to(device)` never moves
            # its buffers: take them to the label's device (a no-op when already there).
            knots, levels = self.knots.to(y.device), self.levels.to(y.device)
            up = _interp(y64, knots, levels)
            down = -_interp(-y64, -knots.flip(0), -levels.flip(0))
            g = torch.special.ndtri((0.5 * (up + down)).clamp(P_BOUND, 1 - P_BOUND))
        return ((g - self.mean) / self.std).to(y.dtype)

    def forward(self, output: torch.Tensor) -> torch.Tensor:
        """The model's output in the label's units (float64)."""
        z = output.double() * self.std + self.mean
        if self.kind == "standardize":
            return z
        if self.kind == "log1p":
            low, high = torch.log1p(self.knots[0]), torch.log1p(self.knots[-1])
            return torch.expm1(z.clamp(low - (high - low), high + (high - low)))
        # The knots sit at evenly spaced levels: the inverse CDF is a direct lookup.
        position = torch.special.ndtr(z) * (self.knots.numel() - 1)
        lo = position.floor().clamp(0, self.knots.numel() - 2)
        i = lo.long()
        return self.knots[i] + (position - lo) * (self.knots[i + 1] - self.knots[i])
