"""Fitting a regression label's transform on the train split (`preprocess.target_transform`).

A heavy-tailed target (prices, durations, counts) standardised as it is puts most rows in a
sliver of the output range and lets a few huge labels dominate the squared error. The model
learns better on a transformed label, and its predictions are mapped back exactly:

- `standardize`: (y - mean) / std;
- `log1p`: log(1 + y), then standardised (labels >= 0); predictions are kept within the train
  labels' log range widened by its own width on each side, so that a wild output cannot
  overflow into an infinite prediction;
- `quantile`: the train split's empirical CDF (piecewise linear between 1,001 quantiles) then
  the standard normal's inverse CDF: any label distribution becomes a normal one;
- `auto`: log1p when the train labels are all > 0, skewed (skewness over 1) and their log is
  not (within ±1): a price or a duration, whose errors scale with it. Otherwise standardize.
  Not log1p for labels with zeros: a count that is mostly 0 learned in log space predicts
  something near its median, and its R² fell from 0.083 to 0.025 (statsmodels' randhie). Not
  quantile either, for the same reason: it is there to be chosen.

The statistics take one pass in bounded memory: running sums of shifted powers for the
moments, and a deterministic sample of at most SAMPLE_ROWS labels, taken by stride over the
split's row count, for the quantiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

__all__ = ["KNOTS", "SAMPLE_ROWS", "SKEW_LIMIT", "TargetFit", "TargetStats", "quantile_forward"]

TargetKind = Literal["standardize", "log1p", "quantile"]
KNOTS = 1001  # quantiles at probability levels 0, 0.001, ..., 1
SAMPLE_ROWS = 200_000  # labels kept for the quantiles, whatever the split's size
SKEW_LIMIT = 1.0  # |skewness| up to which `auto` leaves a label as it is
P_BOUND = 1e-7  # the CDF is clipped to [P_BOUND, 1 - P_BOUND] before the normal's inverse


@dataclass(frozen=True)
class TargetFit:
    """The fitted transform: the model predicts (g(y) - mean) / std."""

    kind: TargetKind
    mean: float
    std: float
    # quantile: the label at levels i / (KNOTS - 1); log1p: the train labels' minimum and maximum
    knots: list[float] = field(default_factory=list)


@dataclass
class _Moments:
    """Sums of powers of (x - shift), for the mean, variance and skewness in float64 without
    the cancellation that raw sums of cubes suffer."""

    shift: float | None = None
    n: int = 0
    s1: float = 0.0
    s2: float = 0.0
    s3: float = 0.0

    def add(self, x: np.ndarray) -> None:
        if x.size == 0:
            return
        if self.shift is None:
            self.shift = float(x.mean())
        d = x - self.shift
        d2 = d * d
        self.n += x.size
        self.s1 += float(d.sum())
        self.s2 += float(d2.sum())
        self.s3 += float((d2 * d).sum())

    @property
    def mean(self) -> float:
        return (self.shift or 0.0) + self.s1 / self.n

    @property
    def std(self) -> float:
        m1 = self.s1 / self.n
        return math.sqrt(max(self.s2 / self.n - m1 * m1, 0.0))

    @property
    def skew(self) -> float:
        m1 = self.s1 / self.n
        var = self.s2 / self.n - m1 * m1
        if var <= 1e-24:
            return 0.0
        m3 = self.s3 / self.n - 3 * m1 * self.s2 / self.n + 2 * m1**3
        return m3 / var**1.5


class TargetStats:
    """Accumulates a split's labels block by block; `fit(kind)` gives the transform."""

    def __init__(self, rows: int) -> None:
        self.stride = max(1, math.ceil(rows / SAMPLE_ROWS))
        self.seen = 0
        self.raw = _Moments()
        self.logged = _Moments()
        self.minimum = math.inf
        self.maximum = -math.inf
        self.sample: list[np.ndarray] = []

    def add(self, label: np.ndarray) -> None:
        y = label.astype(np.float64, copy=False)
        self.raw.add(y)
        if y.size:
            self.minimum = min(self.minimum, float(y.min()))
            self.maximum = max(self.maximum, float(y.max()))
        if self.minimum >= 0:
            self.logged.add(np.log1p(y))
        first = (-self.seen) % self.stride  # the rows whose split-wide index is a multiple of the stride
        self.sample.append(y[first::self.stride].copy())
        self.seen += y.size

    def choose(self) -> TargetKind:
        """`auto`'s choice (see the module docstring)."""
        if self.raw.n and self.minimum > 0 and self.raw.skew > SKEW_LIMIT and abs(self.logged.skew) <= SKEW_LIMIT:
            return "log1p"
        return "standardize"

    def fit(self, kind: TargetKind | Literal["auto"]) -> TargetFit:
        if kind == "auto":
            kind = self.choose()
        if self.raw.n == 0:
            return TargetFit("standardize", 0.0, 1.0)
        if kind == "log1p":
            if self.minimum < 0:
                raise ValueError(f"the train split has a label of {self.minimum:g}; log1p needs labels >= 0")
            return TargetFit("log1p", self.logged.mean, _nonzero(self.logged.std), [self.minimum, self.maximum])
        if kind == "quantile":
            sample = np.sort(np.concatenate(self.sample))
            knots = np.quantile(sample, np.linspace(0.0, 1.0, KNOTS))
            z = quantile_forward(sample, knots)
            return TargetFit("quantile", float(z.mean()), _nonzero(float(z.std())), knots.tolist())
        return TargetFit("standardize", self.raw.mean, _nonzero(self.raw.std))


def _nonzero(std: float) -> float:
    # A constant label keeps std 1: the model then learns the offset alone.
    return std if std > 1e-12 else 1.0


def _interp_both_ways(y: np.ndarray, knots: np.ndarray) -> np.ndarray:
    """The CDF level of `y` between the knots; where knots repeat (a label value that many rows
    share) the middle of their levels, as scikit-learn's QuantileTransformer does."""
    levels = np.linspace(0.0, 1.0, knots.size)
    up = np.interp(y, knots, levels)
    down = -np.interp(-y, -knots[::-1], -levels[::-1])
    return 0.5 * (up + down)


def quantile_forward(y: np.ndarray, knots: np.ndarray) -> np.ndarray:
    """y -> the standard normal quantile of its empirical CDF level."""
    from statistics import NormalDist

    p = np.clip(_interp_both_ways(np.asarray(y, dtype=np.float64), np.asarray(knots)), P_BOUND, 1 - P_BOUND)
    return np.vectorize(NormalDist().inv_cdf, otypes=[np.float64])(p) if p.size else p
