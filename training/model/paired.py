"""How much better a challenger is than the champion on the same test rows, with a confidence
interval: the promotion decision's evidence, so that a difference the test set cannot tell from
noise never replaces a model.

- AUC (binary): DeLong's test for two correlated ROC AUCs, in Sun and Xu's fast form (midranks;
  one sort per model). Exact for the AUC's variance under the null of the two models' scores
  being exchangeable, and O(n log n), so it runs on any test split.
- Every other metric: a paired bootstrap over rows (the same resampled rows for both models),
  percentile interval. Resamples shrink as the split grows, to bound its cost.

The difference is an improvement: challenger minus champion for a higher-is-better metric,
champion minus challenger for a lower-is-better one, so "the interval's lower bound clears
eval.min_delta" reads the same way for every metric.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from training.model.task_metrics import METRICS

__all__ = ["PairedDifference", "paired_difference"]

BOOTSTRAP_ROW_RESAMPLES = 20_000_000  # rows x resamples: about a second of numpy per metric
MIN_TAIL_DRAWS = 5  # fewer draws than this beyond a bound: the bound is read from their spread


@dataclass(frozen=True)
class PairedDifference:
    """The challenger's improvement over the champion on `rows` shared test rows."""

    metric: str
    improvement: float  # positive: the challenger is better
    low: float
    high: float
    confidence: float
    method: str
    rows: int

    def clears(self, min_delta: float) -> bool:
        """The whole interval lies above `min_delta`: the improvement is not noise."""
        return self.low > min_delta

    def describe(self) -> str:
        level = f"{self.confidence:.0%}"
        return (f"improvement {self.improvement:+.4f} ({level} interval {self.low:+.4f} to {self.high:+.4f}, "
                f"{self.method}, {self.rows} paired test rows)")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def paired_difference(task: str, metric: str, y: np.ndarray, challenger: np.ndarray, champion: np.ndarray,
                      confidence: float = 0.95, seed: int = 0, y_champion: np.ndarray | None = None
                      ) -> PairedDifference:
    """The improvement of `challenger`'s predictions over `champion`'s on labels `y` (the same
    rows, in the same order), with its two-sided `confidence` interval. `y_champion`: the same
    labels in the champion's class indices, where a multiclass champion's classes differ."""
    kind = METRICS[task][metric]
    y_b = y if y_champion is None else y_champion
    sign = 1.0 if kind.higher_is_better else -1.0
    if task == "binary" and metric == "auc":
        diff, se = _delong(np.asarray(y).astype(bool).ravel(), np.asarray(challenger, np.float64).ravel(),
                           np.asarray(champion, np.float64).ravel())  # AUC's direction: higher is better
        z = _normal_quantile(0.5 + confidence / 2)
        return PairedDifference(metric, diff, diff - z * se, diff + z * se, confidence, "DeLong", int(np.size(y)))
    n = int(np.shape(y)[0])
    resamples = int(max(200, min(2000, BOOTSTRAP_ROW_RESAMPLES // max(n, 1))))
    rng = np.random.default_rng(seed)
    point = sign * (kind.fn(y, challenger) - kind.fn(y_b, champion))
    draws = np.empty(resamples)
    for b in range(resamples):
        rows = rng.integers(0, n, n)
        draws[b] = sign * (kind.fn(y[rows], challenger[rows]) - kind.fn(y_b[rows], champion[rows]))
    draws = draws[np.isfinite(draws)]
    tail = (1 - confidence) / 2
    if not draws.size:
        return PairedDifference(metric, float(point), math.nan, math.nan, confidence,
                                f"paired bootstrap, {resamples} resamples", n)
    if tail * draws.size < MIN_TAIL_DRAWS:
        # A confidence this high (a pick from many trials) leaves too few draws in a tail for
        # its quantile to be more than the extreme draw: the normal interval from the draws'
        # spread instead.
        z, spread = _normal_quantile(1 - tail), float(np.std(draws, ddof=1))
        return PairedDifference(metric, float(point), float(point - z * spread), float(point + z * spread), confidence,
                                f"paired bootstrap (normal interval), {resamples} resamples", n)
    low, high = np.quantile(draws, [tail, 1 - tail])
    return PairedDifference(metric, float(point), float(low), float(high), confidence,
                            f"paired bootstrap, {resamples} resamples", n)


def _delong(y: np.ndarray, a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(AUC(a) - AUC(b), its standard error) by DeLong's method, a and b scored on the same rows."""
    pos, neg = y, ~y
    m, n = int(pos.sum()), int(neg.sum())
    if m < 2 or n < 2:
        return math.nan, math.nan
    v10, v01, aucs = [], [], []
    for scores in (a, b):
        x, z = scores[pos], scores[neg]
        tx, tz, t = _midranks(x), _midranks(z), _midranks(np.concatenate([x, z]))
        aucs.append((t[:m].sum() / m - (m + 1) / 2) / n)
        v10.append((t[:m] - tx) / n)  # per positive: the share of negatives it outranks
        v01.append(1.0 - (t[m:] - tz) / m)  # per negative: the share of positives that outrank it
    s10, s01 = np.cov(np.vstack(v10)), np.cov(np.vstack(v01))
    var = (s10[0, 0] + s10[1, 1] - 2 * s10[0, 1]) / m + (s01[0, 0] + s01[1, 1] - 2 * s01[0, 1]) / n
    return float(aucs[0] - aucs[1]), float(math.sqrt(max(var, 0.0)))


def _midranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of `x`, tied values sharing their mean rank."""
    order = np.argsort(x, kind="mergesort")
    s = x[order]
    boundaries = np.flatnonzero(np.diff(s)) + 1
    starts = np.concatenate(([0], boundaries))
    ends = np.concatenate((boundaries, [x.size]))
    ranks = np.empty(x.size)
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    return ranks


def _normal_quantile(p: float) -> float:
    """The standard normal's `p` quantile (statistics.NormalDist, without importing scipy)."""
    from statistics import NormalDist

    return NormalDist().inv_cdf(p)
