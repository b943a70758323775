"""Budget stops: a fake clock, a real short budget, and a budget that survives a resume."""

from __future__ import annotations

import itertools

import pytest

from tests.training.helpers import make_job
from training.protocol.events import ChildEvent
from training.config import RetrainConfig
from training.errors import Preempted
from training.trainer.run import StopFlag, train


def _fake_clock(tick: float = 0.01):
    counter = itertools.count()
    return lambda: next(counter) * tick


@pytest.fixture
def budget_config(small_config: RetrainConfig) -> RetrainConfig:
    small_config.train.max_steps = 10_000
    small_config.train.eval_every = 10
    small_config.train.checkpoint.every = 10
    small_config.train.patience = 0
    return small_config


def test_fake_clock_budget_stop_is_graceful_and_bounded(budget_config: RetrainConfig) -> None:
    budget_config.budget.max_wall_seconds = 20.0
    result = train(make_job(budget_config), now_fn=_fake_clock())
    assert result.status == "budget_stopped"
    assert "budget.max_wall_seconds=20" in result.stop_reason
    per_step = (result.seconds.train + result.seconds.checkpoint) / result.steps
    interval = 10 * per_step + result.seconds.eval / len(result.history)
    assert result.billed_seconds <= 20.0 + interval  # never over by more than one validation interval
    assert result.model.sha256  # the best model was exported


def test_dollar_budget_uses_the_declared_rate(budget_config: RetrainConfig) -> None:
    job = make_job(budget_config)
    job.rate_per_hour = 3600.0  # $1 per second of held machine
    budget_config.budget.max_usd = 15.0
    job.config = budget_config
    result = train(job, now_fn=_fake_clock())
    assert result.status == "budget_stopped" and "budget.max_usd=15" in result.stop_reason


def test_real_short_budget(budget_config: RetrainConfig) -> None:
    budget_config.budget.max_wall_seconds = 2.0
    result = train(make_job(budget_config))
    assert result.status == "budget_stopped"
    assert result.steps < 10_000


def test_budget_survives_a_kill_and_resume(budget_config: RetrainConfig) -> None:
    budget_config.budget.max_wall_seconds = 20.0
    reference = train(make_job(budget_config, "reference"), now_fn=_fake_clock())
    job = make_job(budget_config, "resumed")
    stop = StopFlag()

    def stop_at_40(event: ChildEvent) -> None:
        if event.event == "checkpoint" and event.step == 40:
            stop.request("test")

    with pytest.raises(Preempted):
        train(job, stop, stop_at_40, now_fn=_fake_clock())
    resumed = train(job, now_fn=_fake_clock())
    # The spend so far came back from the checkpoint: the resumed run stops where the
    # uninterrupted one did, not 20 fresh seconds later.
    assert resumed.status == "budget_stopped"
    assert resumed.steps <= reference.steps
    assert resumed.resumed_from_steps == [40]


def test_champion_gate_stops_a_hopeless_run(budget_config: RetrainConfig) -> None:
    budget_config.budget.champion_gate = True
    budget_config.train.max_steps = 200
    job = make_job(budget_config)
    job.champion_val_metric = 0.99  # unreachable for this model and data
    job.config = budget_config
    result = train(job)
    assert result.status == "early_stopped"
    assert result.stop_reason.startswith("champion gate")
    assert 30 <= result.steps < 200  # an optimistic linear trend no longer reaches the champion


@pytest.mark.slow
def test_budget_survives_a_real_sigkill(budget_config: RetrainConfig) -> None:
    import signal

    from tests.training.trainer.test_preemption import _signal_at_step
    from training.launch.process import run_training_process

    budget_config.budget.max_wall_seconds = 12.0
    budget_config.cost.tags = {"team": "ranking"}
    job = make_job(budget_config)
    on_start, seen = _signal_at_step(job, 150, signal.SIGKILL)
    with pytest.raises(Preempted):
        run_training_process(job, on_start=on_start)
    final = run_training_process(job)
    assert final.status == "budget_stopped"
    assert final.preemptions == 1
    # Both process start-ups and the killed attempt's lost work are on the bill ...
    assert final.seconds.lost >= 0 and final.seconds.startup > 0
    assert len(final.resumed_from_steps) == 1 and final.resumed_from_steps[0] >= 100  # background writes: maybe one or two behind
    # ... and the carried-over spend is what stopped it. The overshoot bound itself is asserted
    # with the fake clock above: on a shared machine one real step can take any time.
    assert "budget.max_wall_seconds=12" in final.stop_reason
    import json
    from pathlib import Path

    assert json.loads((Path(job.run_dir) / "model" / "model.json").read_text())["tags"] == {"team": "ranking"}


def test_a_budget_stopped_run_continues_from_its_checkpoint_with_a_larger_budget(budget_config: RetrainConfig) -> None:
    budget_config.budget.max_wall_seconds = 20.0
    first = train(make_job(budget_config, "budgeted"), now_fn=_fake_clock())
    assert first.status == "budget_stopped"
    again = train(make_job(budget_config, "budgeted"), now_fn=_fake_clock())  # the same budget: finished
    assert again.already_complete and again.steps == first.steps

    budget_config.budget.max_wall_seconds = 40.0  # not part of the run key: the same run goes on
    more = train(make_job(budget_config, "budgeted"), now_fn=_fake_clock())
    assert not more.already_complete and more.status == "budget_stopped" and more.steps > first.steps
    assert first.steps in more.resumed_from_steps  # from its checkpoint, not from scratch
    assert "budget.max_wall_seconds=40" in (more.stop_reason or "")
    assert first.preemptions == more.preemptions == 0  # a budget's stop is no preemption
