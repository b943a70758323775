"""Exact binary-classification metrics on numpy arrays (no sampling, no binning)."""

from __future__ import annotations

import numpy as np

__all__ = ["roc_auc", "log_loss", "accuracy"]


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
