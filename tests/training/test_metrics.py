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


@pytest.mark.parametrize("seed", range(3))
def test_multiclass_and_regression_metrics_equal_scikit_learn(seed: int) -> None:
    from sklearn import metrics as sk

    from training.metrics import mae, macro_f1, multiclass_accuracy, multiclass_log_loss, r2, rmse

    rng = np.random.default_rng(seed)
    y = rng.integers(0, 4, 500)
    prob = rng.dirichlet(np.ones(4), 500)
    assert multiclass_accuracy(y, prob) == pytest.approx(sk.accuracy_score(y, prob.argmax(1)), abs=1e-12)
    assert macro_f1(y, prob) == pytest.approx(sk.f1_score(y, prob.argmax(1), average="macro"), abs=1e-12)
    assert multiclass_log_loss(y, prob) == pytest.approx(sk.log_loss(y, prob, labels=[0, 1, 2, 3]), abs=1e-9)
    target, pred = rng.normal(10, 3, 500), rng.normal(10, 3, 500)
    assert rmse(target, pred) == pytest.approx(sk.root_mean_squared_error(target, pred), abs=1e-12)
    assert mae(target, pred) == pytest.approx(sk.mean_absolute_error(target, pred), abs=1e-12)
    assert r2(target, pred) == pytest.approx(sk.r2_score(target, pred), abs=1e-12)


def test_metric_names_of_the_config_are_those_of_the_tasks() -> None:
    from training.config import TASK_METRICS
    from training.model.objectives import TASKS
    from training.model.task_metrics import DEFAULT_METRIC, METRICS

    assert {name: tuple(t.metrics) for name, t in TASKS.items()} == TASK_METRICS
    assert {name: tuple(m) for name, m in METRICS.items()} == TASK_METRICS
    assert all(TASK_METRICS[name][0] == t.default_metric == DEFAULT_METRIC[name] for name, t in TASKS.items())
