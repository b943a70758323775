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

The statistics take one pass in bounded memory and merge across segments: the moments
(`training.data.prepare.moments`), and a deterministic sample of at most SAMPLE_ROWS labels a segment,
taken by stride over its row count, for the quantiles (each kept label stands for `stride`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from training.data.prepare.moments import Moments

__all__ = ["KNOTS", "SAMPLE_ROWS", "SKEW_LIMIT", "TargetFit", "TargetStats", "quantile_forward", "weighted_quantiles"]

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


class TargetStats:
    """A split's labels, accumulated batch by batch (`add`) and merged across segments (`merge`);
    `fit(kind)` gives the transform."""

    def __init__(self, rows: int) -> None:
        self.stride = max(1, math.ceil(rows / SAMPLE_ROWS))  # the sample keeps every stride-th label
        self.seen = 0
        self.raw = Moments.empty(1)
        self.logged = Moments.empty(1)  # of log1p(y); meaningful while every label is >= 0
        self.samples: list[tuple[np.ndarray, int]] = []  # (labels, the stride they were kept at)

    @property
    def minimum(self) -> float:
        return float(self.raw.minimum[0])

    @property
    def maximum(self) -> float:
        return float(self.raw.maximum[0])

    def add(self, label: np.ndarray) -> None:
        y = label.astype(np.float64, copy=False).reshape(-1)
        if y.size == 0:
            return
        self.raw = self.raw.add(y)
        if self.minimum >= 0:
            self.logged = self.logged.add(np.log1p(y))
        first = (-self.seen) % self.stride  # the rows whose index in the split is a multiple of the stride
        self.samples.append((y[first::self.stride].copy(), self.stride))
        self.seen += y.size

    def merge(self, other: TargetStats) -> TargetStats:
        """The labels of both; the sample thinned to about SAMPLE_ROWS labels (each kept label then
        stands for more), so merging many segments holds a bounded sample."""
        out = TargetStats(0)
        out.seen = self.seen + other.seen
        out.raw = self.raw.merge(other.raw)
        out.logged = self.logged.merge(other.logged)
        out.samples = [*self.samples, *other.samples]
        kept = sum(v.size for v, _ in out.samples)
        if kept > 2 * SAMPLE_ROWS:
            k = -(-kept // SAMPLE_ROWS)
            out.samples = [(v[::k], w * k) for v, w in out.samples]
        return out

    def arrays(self) -> dict[str, np.ndarray]:
        values = np.concatenate([v for v, _ in self.samples]) if self.samples else np.zeros(0)
        weights = np.concatenate([np.full(v.size, w, dtype=np.int64) for v, w in self.samples]) if self.samples \
            else np.zeros(0, dtype=np.int64)
        return {**self.raw.arrays("label"), **self.logged.arrays("label_log1p"), "label.sample": values,
                "label.sample_weight": weights, "label.seen": np.array(self.seen)}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> TargetStats:
        out = cls(0)
        out.raw, out.logged = Moments.from_arrays(arrays, "label"), Moments.from_arrays(arrays, "label_log1p")
        out.seen = int(np.asarray(arrays["label.seen"]).reshape(-1)[0])
        values, weights = np.asarray(arrays["label.sample"]), np.asarray(arrays["label.sample_weight"])
        out.samples = [(values[weights == w], int(w)) for w in np.unique(weights)]
        return out

    def choose(self) -> TargetKind:
        """`auto`'s choice (see the module docstring)."""
        skew, log_skew = float(self.raw.skew[0]), float(self.logged.skew[0])
        if self.raw.n[0] and self.minimum > 0 and skew > SKEW_LIMIT and abs(log_skew) <= SKEW_LIMIT:
            return "log1p"
        return "standardize"

    def fit(self, kind: TargetKind | Literal["auto"]) -> TargetFit:
        if kind == "auto":
            kind = self.choose()
        if self.raw.n[0] == 0:
            return TargetFit("standardize", 0.0, 1.0)
        if kind == "log1p":
            if self.minimum < 0:
                raise ValueError(f"the train split has a label of {self.minimum:g}; log1p needs labels >= 0")
            return TargetFit("log1p", float(self.logged.mean[0]), _nonzero(float(self.logged.std[0])),
                             [self.minimum, self.maximum])
        if kind == "quantile":
            sample, weights = self._sample()
            knots = weighted_quantiles(sample, weights, np.linspace(0.0, 1.0, KNOTS))
            z = quantile_forward(sample, knots)
            mean = float(np.average(z, weights=weights))
            std = float(np.sqrt(np.average((z - mean) ** 2, weights=weights)))
            return TargetFit("quantile", mean, _nonzero(std), knots.tolist())
        return TargetFit("standardize", float(self.raw.mean[0]), _nonzero(float(self.raw.std[0])))

    def _sample(self) -> tuple[np.ndarray, np.ndarray]:
        """The kept labels in order, and how many labels each stands for."""
        values = np.concatenate([v for v, _ in self.samples])
        weights = np.concatenate([np.full(v.size, w, dtype=np.int64) for v, w in self.samples])
        order = np.argsort(values, kind="stable")
        return values[order], weights[order]


def weighted_quantiles(sorted_values: np.ndarray, weights: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """np.quantile's (linear) quantiles of the array in which each sorted value appears
    `weights` times, without building it: equal weights give np.quantile's exact answer."""
    if sorted_values.size == 0:
        return np.zeros(levels.size)
    if (weights == weights[0]).all() and weights[0] == 1:
        return np.quantile(sorted_values, levels)
    ends = np.cumsum(weights)  # the expanded array's index just past each value's copies
    position = levels * (ends[-1] - 1)
    lo = np.floor(position)
    frac = position - lo
    at = np.searchsorted(ends, lo, side="right")
    at_next = np.searchsorted(ends, np.minimum(lo + 1, ends[-1] - 1), side="right")
    return sorted_values[at] + frac * (sorted_values[at_next] - sorted_values[at])


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
