"""Exact metrics on numpy arrays (no sampling, no binning): binary, multiclass, regression."""

from __future__ import annotations

import numpy as np

__all__ = ["Metrics", "roc_auc", "log_loss", "accuracy", "multiclass_accuracy", "macro_f1", "multiclass_log_loss", "rmse", "mae", "r2"]


# A model's metrics by name (auc, logloss, rmse, ..., and "rows": how many they were taken on).
Metrics = dict[str, float]


def roc_auc(label: np.ndarray, score: np.ndarray) -> float:
    """Exact ROC AUC by the Mann-Whitney rank sum, with tied scores sharing their mean rank."""
    label = np.asarray(label).astype(bool).ravel()
    score = np.asarray(score, dtype=np.float64).ravel()
    n_pos = int(label.sum())
    n_neg = label.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(score, kind="mergesort")
    sorted_scores = score[order]
    ranks = np.empty(score.size, dtype=np.float64)
    # Mean rank per run of equal scores.
    boundaries = np.flatnonzero(np.diff(sorted_scores)) + 1
    starts = np.concatenate(([0], boundaries))
    ends = np.concatenate((boundaries, [score.size]))
    mean_rank = (starts + ends + 1) / 2.0  # ranks are 1-based
    ranks[order] = np.repeat(mean_rank, ends - starts)
    return float((ranks[label].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def log_loss(label: np.ndarray, prob: np.ndarray, eps: float = 1e-7) -> float:
    label = np.asarray(label, dtype=np.float64).ravel()
    p = np.clip(np.asarray(prob, dtype=np.float64).ravel(), eps, 1 - eps)
    return float(-np.mean(label * np.log(p) + (1 - label) * np.log1p(-p)))


def accuracy(label: np.ndarray, prob: np.ndarray, threshold: float = 0.5) -> float:
    label = np.asarray(label).astype(bool).ravel()
    return float(np.mean((np.asarray(prob).ravel() >= threshold) == label))


def _as_class(prob: np.ndarray) -> np.ndarray:
    return np.asarray(prob).argmax(axis=1)


def multiclass_accuracy(label: np.ndarray, prob: np.ndarray) -> float:
    return float(np.mean(_as_class(prob) == np.asarray(label).astype(np.int64).ravel()))


def macro_f1(label: np.ndarray, prob: np.ndarray) -> float:
    """Unweighted mean of per-class F1 over the classes that occur in `label` or the prediction
    (scikit-learn's `f1_score(average="macro")`, which counts an absent class's F1 as 0)."""
    y = np.asarray(label).astype(np.int64).ravel()
    pred = _as_class(prob)
    n = np.asarray(prob).shape[1]
    tp = np.bincount(y[pred == y], minlength=n).astype(np.float64)
    predicted = np.bincount(pred, minlength=n).astype(np.float64)
    actual = np.bincount(y, minlength=n).astype(np.float64)
    present = (predicted + actual) > 0
    f1 = np.divide(2 * tp, predicted + actual, out=np.zeros(n), where=present)
    return float(f1[present].mean()) if present.any() else float("nan")


def multiclass_log_loss(label: np.ndarray, prob: np.ndarray, eps: float = 1e-7) -> float:
    y = np.asarray(label).astype(np.int64).ravel()
    p = np.clip(np.asarray(prob, dtype=np.float64)[np.arange(y.size), y], eps, 1.0)
    return float(-np.mean(np.log(p)))


def rmse(label: np.ndarray, pred: np.ndarray) -> float:
    d = np.asarray(pred, dtype=np.float64).ravel() - np.asarray(label, dtype=np.float64).ravel()
    return float(np.sqrt(np.mean(d * d)))


def mae(label: np.ndarray, pred: np.ndarray) -> float:
    return float(np.mean(np.abs(np.asarray(pred, dtype=np.float64).ravel() - np.asarray(label, dtype=np.float64).ravel())))


def r2(label: np.ndarray, pred: np.ndarray) -> float:
    y = np.asarray(label, dtype=np.float64).ravel()
    residual = float(np.sum((y - np.asarray(pred, dtype=np.float64).ravel()) ** 2))
    total = float(np.sum((y - y.mean()) ** 2))
    return 1.0 - residual / total if total > 0 else float("nan")
