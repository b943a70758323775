"""Feature drift: how far new rows' distribution moved from the rows a model was trained on.

At preprocessing, each feature's training distribution is binned and stored with the feature
statistics (`DriftReference`): a numeric column in deciles of its train values (plus a bin for
nulls), a categorical column as its 20 most frequent values, the rest, and nulls. New segments'
statistics are binned the same way and compared by the population stability index,

    PSI = sum over bins of (new - reference) * ln(new / reference)

which is about 0 for the same distribution; 0.1 to 0.2 is usually read as a moderate shift and
over 0.2 as a large one. Both sides come from the segments' statistics (samples and category
counts taken at packing), so a drift check reads no shards.
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict

from training.data.ingest.segment_stats import SegmentStats
from training.data.ingest.validation import MISSING_CATEGORY
from training.data.prepare.target import weighted_quantiles

__all__ = ["DriftReference", "drift_reference", "feature_drift", "psi"]

_DECILES = np.linspace(0.1, 0.9, 9)
_TOP_CATEGORIES = 20
_FLOOR = 1e-4  # an empty bin counts as this share, so that ln stays finite


class NumericBins(BaseModel):
    model_config = ConfigDict(frozen=True)

    edges: list[float]  # interior edges; bin i holds edges[i-1] <= x < edges[i]
    shares: list[float]  # each bin's share of the rows, then the share of nulls


class CategoryBins(BaseModel):
    model_config = ConfigDict(frozen=True)

    values: list[int]  # category hashes, most frequent first
    shares: list[float]  # each value's share, then the rest's, then the nulls'


class DriftReference(BaseModel):
    """A model's training distribution, per feature, binned for PSI."""

    model_config = ConfigDict(frozen=True)

    rows: int
    numeric: dict[str, NumericBins]
    categorical: dict[str, CategoryBins]


def _numeric_shares(values: np.ndarray, weights: np.ndarray, edges: np.ndarray, rows: int, n: int) -> list[float]:
    finite = np.isfinite(values)
    counts = np.bincount(np.searchsorted(edges, values[finite], side="right"), weights=weights[finite],
                         minlength=edges.size + 1)
    total = counts.sum()
    present = counts / total if total else np.zeros(edges.size + 1)
    null_share = 1.0 - n / rows if rows else 0.0
    return [*(present * (1.0 - null_share)).tolist(), null_share]


def drift_reference(stats: SegmentStats, numeric: list[str], categorical: list[str]) -> DriftReference:
    """The reference bins of a dataset's train rows (its merged segment statistics)."""
    bins: dict[str, NumericBins] = {}
    for j, name in enumerate(numeric):
        column = stats.numeric_sample[:, j].astype(np.float64)
        finite = np.isfinite(column)
        order = np.argsort(column[finite], kind="stable")
        values, weights = column[finite][order], stats.numeric_sample_weight[finite][order]
        edges = np.unique(weighted_quantiles(values, weights, _DECILES)) if values.size else np.zeros(0)
        bins[name] = NumericBins(edges=edges.tolist(), shares=_numeric_shares(
            stats.numeric_sample[:, j].astype(np.float64), stats.numeric_sample_weight, edges, stats.rows,
            int(stats.numeric.n[j])))
    cats: dict[str, CategoryBins] = {}
    for j, name in enumerate(categorical):
        counts = stats.categories[j]
        known = counts.values != MISSING_CATEGORY
        top = np.argsort(-counts.counts[known], kind="stable")[:_TOP_CATEGORIES]
        values = counts.values[known][top]
        cats[name] = CategoryBins(values=values.tolist(), shares=_category_shares(stats, j, values))
    return DriftReference(rows=stats.rows, numeric=bins, categorical=cats)


def _category_shares(stats: SegmentStats, j: int, values: np.ndarray) -> list[float]:
    counts = stats.categories[j]
    total = max(1, stats.rows)
    lookup = dict(zip(counts.values.tolist(), counts.counts.tolist(), strict=True))
    shares = [lookup.get(int(v), 0) / total for v in values]
    nulls = lookup.get(MISSING_CATEGORY, 0) / total
    return [*shares, max(0.0, 1.0 - sum(shares) - nulls), nulls]


def psi(reference: list[float], new: list[float]) -> float:
    e = np.maximum(np.asarray(reference, dtype=np.float64), _FLOOR)
    a = np.maximum(np.asarray(new, dtype=np.float64), _FLOOR)
    return float(np.sum((a - e) * np.log(a / e)))


def feature_drift(reference: DriftReference, new: SegmentStats, numeric: list[str],
                  categorical: list[str]) -> dict[str, float]:
    """PSI of every feature of `new` (merged statistics of new segments) against the reference."""
    out: dict[str, float] = {}
    for j, name in enumerate(numeric):
        ref = reference.numeric.get(name)
        if ref is None:
            continue
        shares = _numeric_shares(new.numeric_sample[:, j].astype(np.float64), new.numeric_sample_weight,
                                 np.asarray(ref.edges), new.rows, int(new.numeric.n[j]))
        out[name] = psi(ref.shares, shares)
    for j, name in enumerate(categorical):
        cref = reference.categorical.get(name)
        if cref is None:
            continue
        out[name] = psi(cref.shares, _category_shares(new, j, np.asarray(cref.values, dtype=np.int64)))
    return out
