"""The stopping policy on its own: budgets, plateau and champion gate from a Progress, no loop."""

from __future__ import annotations

from training.config import load_config
from training.protocol.results import Validation
from training.trainer.state import EarlyStopping
from training.trainer.stopping import Budget, StopPolicy, champion_gate
from training.trainer.state import Progress


def _v(step: int, **metrics: float) -> Validation:
    return Validation(step=step, train_loss=0.0, metrics=metrics)


def _progress(step: int, train_seconds: float, history: list[float] | None = None) -> Progress:
    p = Progress(step=step)
    p.seconds.train = train_seconds
    p.history = [Validation(step=(i + 1) * 10, train_loss=0.0, metrics={"auc": auc}) for i, auc in enumerate(history or [])]
    return p


def test_a_budget_stops_before_the_next_interval_would_cross_it() -> None:
    config = load_config(overrides=["budget.max_wall_seconds=100", "train.eval_every=10"])
    budget = Budget(config.budget, rate_per_hour=0.0, gpus=0)
    assert budget.exceeded(_progress(step=10, train_seconds=50), next_steps=10) is None  # 50 s + 50 s = 100 s
    reason = budget.exceeded(_progress(step=10, train_seconds=60), next_steps=10)  # 60 s + 60 s > 100 s
    assert reason is not None and reason.startswith("budget.max_wall_seconds=100")
    assert budget.exceeded(_progress(step=10, train_seconds=60), next_steps=0) is None  # not crossed yet


def test_dollar_and_gpu_hour_budgets_use_the_rate_and_gpus() -> None:
    config = load_config(overrides=["budget.max_usd=1", "budget.max_gpu_hours=0.5"])
    dollars = Budget(config.budget, rate_per_hour=3.6, gpus=1)  # $0.001 per second
    assert "budget.max_usd=1" in (dollars.exceeded(_progress(10, 1001), 0) or "")
    free = Budget(config.budget, rate_per_hour=0.0, gpus=4)  # a free machine still holds 4 GPUs
    assert "budget.max_gpu_hours=0.5" in (free.exceeded(_progress(10, 451), 0) or "")
    assert Budget(load_config().budget, 3.6, 1).active is False


def test_the_champion_gate_stops_only_when_the_trend_cannot_reach_the_champion() -> None:
    flat = [_v(s, auc=0.70) for s in (10, 20, 30)]
    assert champion_gate(flat, champion_value=0.80, min_delta=0.0, max_steps=100) is not None
    rising = [_v(s, auc=a) for s, a in ((10, 0.60), (20, 0.65), (30, 0.70))]
    assert champion_gate(rising, champion_value=0.80, min_delta=0.0, max_steps=100) is None  # 0.70 + 70 * 0.005
    assert champion_gate(flat[:2], champion_value=0.80, min_delta=0.0, max_steps=100) is None  # too few points
    assert champion_gate(flat, champion_value=None, min_delta=0.0, max_steps=100) is None  # no champion


def test_the_policy_orders_budget_then_plateau_then_gate() -> None:
    config = load_config(overrides=["train.patience=2", "train.eval_every=10", "train.max_steps=100",
                                    "budget.champion_gate=true"])
    policy = StopPolicy(config, rate_per_hour=0.0, gpus=0, champion_value=0.9)
    stopper = EarlyStopping(patience=2, min_delta=0.0)
    progress = _progress(30, 3.0, [0.70, 0.70, 0.70])
    assert policy.decide(progress, stopper, validated=False).status == "completed"  # only at validations
    assert policy.decide(progress, stopper, validated=True).reason.startswith("champion gate")  # type: ignore[union-attr]
    for step in (10, 20, 30):
        stopper.update(0.70, step)
    decision = policy.decide(progress, stopper, validated=True)
    assert decision.status == "early_stopped" and decision.reason and "no validation AUC gain" in decision.reason
    config.budget.max_wall_seconds = 1.0
    over = StopPolicy(config, 0.0, 0, 0.9).decide(progress, stopper, validated=False)
    assert over.status == "budget_stopped" and over.validate_first  # the best must be validated first


def test_lower_is_better_metrics_stop_and_gate_the_other_way() -> None:
    """rmse: a falling value is progress; the gate extrapolates downwards towards the champion."""
    stopper = EarlyStopping(patience=2, min_delta=0.01, higher_is_better=False)
    assert stopper.update(1.0, 10) and stopper.update(0.9, 20)  # lower is a new best
    assert not stopper.update(0.895, 30) and not stopper.update(0.95, 40)  # within min_delta, then worse
    assert stopper.should_stop and stopper.best == 0.9
    falling = [_v(s, rmse=v) for s, v in ((10, 1.2), (20, 1.1), (30, 1.0))]
    assert champion_gate(falling, 0.5, 0.0, 100, "rmse", higher_is_better=False) is None  # 1.0 - 70 * 0.01
    flat = [_v(s, rmse=1.0) for s in (10, 20, 30)]
    reason = champion_gate(flat, 0.8, 0.0, 100, "rmse", higher_is_better=False)
    assert reason is not None and "at least 1.0000" in reason and "needs 0.8000" in reason


def test_a_run_that_reached_max_steps_completed_even_when_its_patience_ran_out_there() -> None:
    config = load_config(overrides=["train.patience=2", "train.eval_every=10", "train.max_steps=30"])
    stopper = EarlyStopping(patience=2, min_delta=0.0)
    for step in (10, 20, 30):
        stopper.update(0.70, step)
    assert stopper.should_stop
    decision = StopPolicy(config, 0.0, 0, None).decide(_progress(30, 3.0, [0.7, 0.7, 0.7]), stopper, validated=True)
    assert decision.status == "completed" and decision.reason is None


def test_a_tie_keeps_the_step_with_the_lower_loss_and_is_not_a_gain() -> None:
    """Accuracy on a small split tops out and ties at every validation: the earliest tie used to
    be kept, though its loss says a later one is the better model."""
    stopper = EarlyStopping(patience=3, min_delta=1e-4)
    assert stopper.update(0.9, 10, tiebreak=0.40)
    assert stopper.update(1.0, 20, tiebreak=0.30)  # a gain
    assert stopper.update(1.0, 30, tiebreak=0.12)  # a tie with a lower loss: kept
    assert not stopper.update(1.0, 40, tiebreak=0.50)  # a tie with a higher loss: not kept
    assert not stopper.update(0.9, 50, tiebreak=0.01)  # worse on the metric: the loss does not matter
    assert (stopper.best, stopper.best_step, stopper.best_tiebreak) == (1.0, 30, 0.12)
    assert stopper.should_stop  # three validations since the last gain, ties included
    resumed = EarlyStopping(patience=3, min_delta=1e-4)
    resumed.load_state_dict(stopper.state_dict())
    assert resumed == stopper
    old = {k: v for k, v in stopper.state_dict().items() if k != "best_tiebreak"}  # a checkpoint from before
    resumed.load_state_dict(old)
    assert resumed.best_tiebreak is None and not resumed.update(1.0, 60, tiebreak=0.0)


def test_a_lower_is_better_metric_ties_the_same_way() -> None:
    stopper = EarlyStopping(patience=0, min_delta=0.0, higher_is_better=False)
    assert stopper.update(2.0, 10, tiebreak=2.0) and stopper.update(2.0, 20, tiebreak=1.5)
    assert not stopper.update(2.5, 30, tiebreak=1.0)
    assert stopper.best_step == 20


def test_a_small_validation_split_is_said_once_in_the_words_of_its_metric(caplog) -> None:  # type: ignore[no-untyped-def]
    """Accuracy on 30 rows is coarse (ties are broken by the loss); RMSE is continuous, only noisy."""
    import logging
    from types import SimpleNamespace

    from training.trainer.trainer import Trainer

    def said(task: str, metric: str, rows: int) -> list[str]:
        caplog.clear()
        fake = SimpleNamespace(rank=0, manifest=SimpleNamespace(rows={"validation": rows}),
                               task=SimpleNamespace(name=task), metric=metric)
        with caplog.at_level(logging.WARNING, logger="training.trainer.trainer"):
            Trainer._say_if_validation_is_small(fake)  # type: ignore[arg-type]
        return [r.getMessage() for r in caplog.records]

    (coarse,) = said("multiclass", "accuracy", 30)
    assert "holds 30 rows" in coarse and "among equal accuracy values" in coarse and "lowest validation logloss" in coarse
    (noisy,) = said("regression", "rmse", 43)
    assert "rmse is noisy there" in noisy and "lowest" not in noisy
    assert said("binary", "auc", 20_000) == []
