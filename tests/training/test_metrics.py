from __future__ import annotations

import numpy as np
import pytest

from training.metrics import accuracy, log_loss, roc_auc


def _pairwise_auc(y: np.ndarray, s: np.ndarray) -> float:
    pos, neg = s[y == 1], s[y == 0]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", range(5))
def test_auc_is_exact_with_ties(seed: int) -> None:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, 400)
    s = rng.integers(0, 20, 400).astype(float)  # many ties
    assert roc_auc(y, s) == pytest.approx(_pairwise_auc(y, s), abs=1e-12)


def test_auc_edges() -> None:
    assert roc_auc(np.array([0, 0, 1, 1]), np.array([0.1, 0.2, 0.8, 0.9])) == 1.0
    assert roc_auc(np.array([0, 0, 1, 1]), np.array([0.9, 0.8, 0.2, 0.1])) == 0.0
    assert np.isnan(roc_auc(np.array([1, 1]), np.array([0.1, 0.2])))


def test_log_loss_and_accuracy() -> None:
    y = np.array([1, 0])
    p = np.array([0.8, 0.3])
    assert log_loss(y, p) == pytest.approx(-(np.log(0.8) + np.log(0.7)) / 2)
    assert accuracy(y, p) == 1.0
