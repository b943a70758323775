"""Count, mean, central moments, minimum and maximum of columns, accumulated batch by batch and
merged across segments without a second pass: Chan et al.'s pairwise update for M2 and
Pébay's for M3 ("Formulas for robust, one-pass parallel computation of covariances and
arbitrary-order statistical moments", 2008). Nulls (NaN) are not counted."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Moments"]


@dataclass
class Moments:
    """Per column: n, mean, M2 = sum (x - mean)^2, M3 = sum (x - mean)^3, min, max."""

    n: np.ndarray
    mean: np.ndarray
    m2: np.ndarray
    m3: np.ndarray
    minimum: np.ndarray
    maximum: np.ndarray

    @classmethod
    def empty(cls, columns: int) -> Moments:
        zeros = np.zeros(columns, dtype=np.float64)
        return cls(np.zeros(columns, dtype=np.int64), zeros.copy(), zeros.copy(), zeros.copy(),
                   np.full(columns, np.inf), np.full(columns, -np.inf))

    @classmethod
    def of(cls, x: np.ndarray) -> Moments:
        """The moments of the rows of `x` (rows, columns); NaN is left out."""
        x = np.asarray(x, dtype=np.float64).reshape(len(x), -1)
        finite = np.isfinite(x)
        if finite.all():  # the usual case: the same sums, in half the passes over the rows
            mean = x.sum(axis=0) / len(x)
            d = x - mean
            d2 = d * d
            return cls(np.full(x.shape[1], len(x), dtype=np.int64), mean, d2.sum(axis=0), (d2 * d).sum(axis=0),
                       x.min(axis=0, initial=np.inf), x.max(axis=0, initial=-np.inf))
        n = finite.sum(axis=0).astype(np.int64)
        safe = np.where(finite, x, 0.0)
        mean = np.divide(safe.sum(axis=0), n, out=np.zeros(x.shape[1]), where=n > 0)
        d = np.where(finite, x - mean, 0.0)
        d2 = d * d
        return cls(n, mean, d2.sum(axis=0), (d2 * d).sum(axis=0),
                   np.where(finite, x, np.inf).min(axis=0, initial=np.inf),
                   np.where(finite, x, -np.inf).max(axis=0, initial=-np.inf))

    def merge(self, other: Moments) -> Moments:
        na, nb = self.n.astype(np.float64), other.n.astype(np.float64)
        n = na + nb
        with np.errstate(invalid="ignore", divide="ignore"):
            delta = other.mean - self.mean
            mean = np.where(n > 0, self.mean + delta * nb / n, 0.0)
            m2 = self.m2 + other.m2 + np.where(n > 0, delta * delta * na * nb / n, 0.0)
            m3 = (self.m3 + other.m3
                  + np.where(n > 0, delta**3 * na * nb * (na - nb) / (n * n), 0.0)
                  + np.where(n > 0, 3.0 * delta * (na * other.m2 - nb * self.m2) / n, 0.0))
        return Moments(self.n + other.n, mean, m2, m3, np.minimum(self.minimum, other.minimum),
                       np.maximum(self.maximum, other.maximum))

    def add(self, x: np.ndarray) -> Moments:
        return self.merge(Moments.of(x))

    @property
    def variance(self) -> np.ndarray:
        """The population variance (divided by n, as standardisation has always used)."""
        return np.divide(self.m2, self.n, out=np.zeros_like(self.m2), where=self.n > 0)

    @property
    def std(self) -> np.ndarray:
        return np.sqrt(np.maximum(self.variance, 0.0))

    @property
    def skew(self) -> np.ndarray:
        var = self.variance
        with np.errstate(invalid="ignore", divide="ignore"):
            out = np.where(var > 1e-24, (self.m3 / np.maximum(self.n, 1)) / np.maximum(var, 1e-300) ** 1.5, 0.0)
        return out

    def arrays(self, prefix: str) -> dict[str, np.ndarray]:
        return {f"{prefix}.{k}": getattr(self, k) for k in ("n", "mean", "m2", "m3", "minimum", "maximum")}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], prefix: str) -> Moments:
        return cls(*(np.asarray(arrays[f"{prefix}.{k}"]) for k in ("n", "mean", "m2", "m3", "minimum", "maximum")))
