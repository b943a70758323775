"""Sufficient statistics of a segment's train rows, taken while it is packed, that merge.

A dataset's feature statistics are the merge of its segments' (`merge_stats`), so adding a
segment costs that segment, never a pass over the others:

- numeric columns: count, mean, M2, M3, min and max (`training.data.prepare.moments`), and a sample of
  rows for quantiles (drift bins);
- categorical columns: the count of every value (by its 63-bit hash);
- a regression label: its moments and a sample (`training.data.prepare.target.TargetStats`).

Stored as `stats.npz` in the segment, with fixed zip dates: the same rows give the same bytes.
"""

from __future__ import annotations

import io
import math
import zipfile
from dataclasses import dataclass

import numpy as np

from training.data.prepare.moments import Moments
from training.data.prepare.target import TargetStats
from training.data.shards import encode_npy

__all__ = ["NUMERIC_SAMPLE_ROWS", "CategoryCounts", "SegmentStats", "SegmentStatsBuilder", "StatsDamage", "merge_stats",
           "parse_stats_arrays", "stats_damage"]

NUMERIC_SAMPLE_ROWS = 4096  # rows of numerics kept a segment, for quantile bins (drift)
MERGED_SAMPLE_ROWS = 65_536  # ... and at most (about) this many in a dataset's merged statistics


@dataclass
class CategoryCounts:
    """Distinct values (sorted hashes) and how many rows hold each."""

    values: np.ndarray
    counts: np.ndarray

    @classmethod
    def of(cls, parts: list[tuple[np.ndarray, np.ndarray]]) -> CategoryCounts:
        if not parts:
            return cls(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
        values = np.concatenate([v for v, _ in parts])
        counts = np.concatenate([c for _, c in parts])
        unique, inverse = np.unique(values, return_inverse=True)
        return cls(unique.astype(np.int64), np.bincount(inverse, weights=counts, minlength=unique.size).astype(np.int64))


@dataclass
class SegmentStats:
    """What a segment's train rows contribute to the dataset's statistics."""

    rows: int  # train rows
    numeric: Moments
    numeric_sample: np.ndarray  # (k, numeric columns) float32, NaN for nulls
    numeric_sample_weight: np.ndarray  # (k,) int64: rows each sampled row stands for
    categories: list[CategoryCounts]
    target: TargetStats | None = None

    def to_bytes(self) -> bytes:
        arrays: dict[str, np.ndarray] = {"rows": np.array(self.rows, dtype=np.int64), **self.numeric.arrays("num"),
                                         "num.sample": self.numeric_sample,
                                         "num.sample_weight": self.numeric_sample_weight}
        for j, counts in enumerate(self.categories):
            arrays[f"cat{j}.values"], arrays[f"cat{j}.counts"] = counts.values, counts.counts
        if self.target is not None:
            arrays.update(self.target.arrays())
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as archive:  # np.load reads it as an .npz
            for name in sorted(arrays):
                archive.writestr(zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0)),
                                 encode_npy(np.asarray(arrays[name])))
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes, categorical: int, regression: bool) -> SegmentStats:
        """The statistics in `data`, checked: a damaged or tampered file raises `StatsDamage`
        (see `stats_damage`), never a statistic that is not finite, a negative count or a
        missing array."""
        a = _arrays(data)
        problem = stats_damage(a, categorical, regression)
        if problem is not None:
            raise StatsDamage(problem)
        return cls(
            rows=int(a["rows"].reshape(-1)[0]), numeric=Moments.from_arrays(a, "num"), numeric_sample=a["num.sample"],
            numeric_sample_weight=a["num.sample_weight"],
            categories=[CategoryCounts(a[f"cat{j}.values"], a[f"cat{j}.counts"]) for j in range(categorical)],
            target=TargetStats.from_arrays(a) if regression else None)


class StatsDamage(ValueError):
    """A segment's stats.npz that cannot be what packing wrote."""


def parse_stats_arrays(data: bytes) -> dict[str, np.ndarray]:
    """The arrays of a stats.npz (`StatsDamage` when it is not a readable one)."""
    return _arrays(data)


def _arrays(data: bytes) -> dict[str, np.ndarray]:
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as err:
        raise StatsDamage(f"not a readable .npz ({err})") from None


_MOMENTS = ("n", "mean", "m2", "m3", "minimum", "maximum")


def stats_damage(a: dict[str, np.ndarray], categorical: int | None = None, regression: bool | None = None,
                 train_rows: int | None = None) -> str | None:
    """Why `a` (a stats.npz's arrays) cannot be a segment's statistics, or None. Packing writes
    finite moments, non-negative counts and arrays whose shapes agree; `train_rows` is the
    segment manifest's, which the statistics are taken over. `categorical` and `regression`
    (None: as the file's arrays say) are what the dataset's config expects."""
    if categorical is None:
        categorical = sum(1 for k in a if k.startswith("cat") and k.endswith(".values"))
    if regression is None:
        regression = "label.seen" in a
    needed = ["rows", "num.sample", "num.sample_weight", *(f"num.{k}" for k in _MOMENTS),
              *(f"cat{j}.{k}" for j in range(categorical) for k in ("values", "counts"))]
    if regression:
        needed += [*(f"{p}.{k}" for p in ("label", "label_log1p") for k in _MOMENTS), "label.sample",
                   "label.sample_weight", "label.seen"]
    missing = [k for k in needed if k not in a]
    if missing:
        return f"array {missing[0]} is missing"
    rows = a["rows"]
    if rows.size != 1 or int(rows.reshape(-1)[0]) < 0:
        return "its row count is not one non-negative number"
    if train_rows is not None and int(rows.reshape(-1)[0]) != train_rows:
        return f"it counts {int(rows.reshape(-1)[0])} train rows where segment.json has {train_rows}"
    for prefix in ("num", "label", "label_log1p") if regression else ("num",):
        problem = _moments_damage(a, prefix)
        if problem is not None:
            return problem
    columns = a["num.n"].shape
    sample, weight = a["num.sample"], a["num.sample_weight"]
    if sample.ndim != 2 or sample.shape[1:] != columns or weight.shape != sample.shape[:1] or (weight < 0).any():
        return f"num.sample {sample.shape} and num.sample_weight {weight.shape} do not fit {columns[0]} numeric columns"
    for j in range(categorical):
        values, counts = a[f"cat{j}.values"], a[f"cat{j}.counts"]
        if values.ndim != 1 or counts.shape != values.shape or (counts < 0).any():
            return f"cat{j}.counts are negative or do not match cat{j}.values"
    return None


def _moments_damage(a: dict[str, np.ndarray], prefix: str) -> str | None:
    n, shape = a[f"{prefix}.n"], a[f"{prefix}.n"].shape
    if n.ndim != 1 or any(a[f"{prefix}.{k}"].shape != shape for k in _MOMENTS):
        return f"the {prefix}.* moments have different shapes"
    if (n < 0).any():
        return f"{prefix}.n holds a negative count"
    for k in ("mean", "m2", "m3"):
        if not np.isfinite(a[f"{prefix}.{k}"]).all():
            return f"{prefix}.{k} holds a value that is not finite"
    if (a[f"{prefix}.m2"] < 0).any():
        return f"{prefix}.m2 is negative"
    # A column with no value yet has the empty bounds (+inf, -inf); one with values, finite ones.
    seen = n > 0
    for k in ("minimum", "maximum"):
        if np.isnan(a[f"{prefix}.{k}"]).any() or not np.isfinite(a[f"{prefix}.{k}"][seen]).all():
            return f"{prefix}.{k} holds a value that is not finite"
    return None


class SegmentStatsBuilder:
    """Accumulates a segment's train rows, batch by batch, in bounded memory."""

    def __init__(self, numeric: int, categorical: int, regression: bool, expected_rows: int) -> None:
        self.numeric = Moments.empty(numeric)
        self.n_numeric = numeric
        self.stride = max(1, math.ceil(expected_rows / NUMERIC_SAMPLE_ROWS))
        self.rows = 0
        self.sample: list[np.ndarray] = []
        self.categories: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(categorical)]
        self.target = TargetStats(expected_rows) if regression else None

    def add(self, num: np.ndarray, cat: np.ndarray, label: np.ndarray) -> None:
        """Train rows: numerics (float32, NaN for nulls), category hashes, labels."""
        if len(label) == 0:
            return
        if self.n_numeric:
            self.numeric = self.numeric.add(num)
        first = (-self.rows) % self.stride  # rows whose index among the train rows is a multiple of the stride
        self.sample.append(np.asarray(num[first::self.stride], dtype=np.float32))
        for j, parts in enumerate(self.categories):
            values, counts = np.unique(cat[:, j], return_counts=True)
            parts.append((values, counts))
            if len(parts) > 64:  # keep the pending parts few: merged as they come
                self.categories[j] = [_merged(parts)]
        if self.target is not None:
            self.target.add(label)
        self.rows += len(label)

    def finish(self) -> SegmentStats:
        sample = (np.concatenate(self.sample) if self.sample else np.zeros((0, self.n_numeric), np.float32))
        return SegmentStats(
            rows=self.rows, numeric=self.numeric, numeric_sample=sample.reshape(len(sample), self.n_numeric),
            numeric_sample_weight=np.full(len(sample), self.stride, dtype=np.int64),
            categories=[CategoryCounts.of(parts) for parts in self.categories], target=self.target)


def _merged(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    merged = CategoryCounts.of(parts)
    return merged.values, merged.counts


def _thinned(values: np.ndarray, weights: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """At most about `cap` rows of a weighted sample: every k-th row, standing for k times as many."""
    if len(values) <= cap:
        return values, weights
    k = -(-len(values) // cap)
    return values[::k], weights[::k] * k


def merge_stats(parts: list[SegmentStats]) -> SegmentStats:
    """The statistics of the union of the segments' train rows. The numeric sample is thinned as
    it grows, so merging N segments holds a sample of at most MERGED_SAMPLE_ROWS rows, whatever N."""
    first = parts[0]
    numeric = first.numeric
    target = first.target
    sample, weight = first.numeric_sample, first.numeric_sample_weight
    for part in parts[1:]:
        numeric = numeric.merge(part.numeric)
        if target is not None and part.target is not None:
            target = target.merge(part.target)
        sample = np.concatenate([sample, part.numeric_sample])
        weight = np.concatenate([weight, part.numeric_sample_weight])
        if len(sample) > 2 * MERGED_SAMPLE_ROWS:
            sample, weight = _thinned(sample, weight, MERGED_SAMPLE_ROWS)
    categories = [CategoryCounts.of([(p.categories[j].values, p.categories[j].counts) for p in parts])
                  for j in range(len(first.categories))]
    sample, weight = _thinned(sample, weight, MERGED_SAMPLE_ROWS)
    return SegmentStats(rows=sum(p.rows for p in parts), numeric=numeric, numeric_sample=sample,
                        numeric_sample_weight=weight, categories=categories, target=target)
