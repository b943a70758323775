"""What a study reports is honest: a budget stop's score is kept, the saving is counted like with
like (the same market, machine seconds) and only for a study that produced a model, and each
trial is plotted at the spend when its work was done."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from training.config import load_config
from training.protocol.results import RungResult
from training.tune.study import RungCost, Study
from training.tune.study_report import build_report, curve_points
from training.model.paired import PairedDifference


def _study(tmp_path: Path, patience: int | None = None, **tune: object) -> Study:
    path = tmp_path / "tune.yaml"
    train = {"max_steps": 180, "eval_every": 20} | ({} if patience is None else {"patience": patience})
    path.write_text(yaml.safe_dump({
        "storage": {"root": str(tmp_path / "root")}, "train": train,
        "cost": {"instance_type": "g4dn.xlarge", "market": "spot"},
        "tune": {"space": {"train.optim.lr": "loguniform(1e-4, 1e-2)"}, "max_trials": 4, "min_resource": 20,
                 "reduction_factor": 3, "pruner": "asha", **tune},
    }))
    return Study(load_config(path), "dataset", RungCost(startup_seconds=0.0, seconds_per_step=0.01))


def test_a_budget_stops_score_is_recorded(tmp_path: Path) -> None:
    study = _study(tmp_path)
    work = study.next_work()
    assert work is not None
    study.record(work, RungResult(run_key="r0", status="budget_stopped", step=14, metric="auc", value=0.71,
                                  billed_seconds=0.14))
    (trial,) = study.trials()
    assert trial.intermediate_values == {14: 0.71} and trial.state.name == "PRUNED"


def test_the_saving_is_like_with_like_and_only_for_a_study_with_a_model(tmp_path: Path) -> None:
    study = _study(tmp_path)
    empty = build_report(study)
    assert empty.best is None and empty.saved_fraction is None  # no model: nothing bought, nothing saved
    while (work := study.next_work()) is not None:
        study.record(work, RungResult(run_key=f"r{work.trial}", status="completed" if work.step == 180 else "paused",
                                      step=work.step, metric="auc", value=0.6 + 0.01 * work.trial,
                                      billed_seconds=work.step * 0.01))
    report = build_report(study)
    assert report.best is not None and report.saved_fraction is not None
    # The naive search on the study's own market (spot), so the saving is the schedule's alone.
    assert report.naive.usd == pytest.approx(report.naive.seconds * report.rate_per_hour / 3600)
    assert report.saved_fraction == pytest.approx(1 - report.spend.seconds / report.naive.seconds)


def _run(study: Study, stop_at: dict[int, int], values: dict[int, list[float]] | None = None) -> None:
    """Every trial to its rungs; trial n early-stops at `stop_at[n]` when it gets that far; trial
    n's value at its i-th rung is `values[n][i]` (else 0.6 + 0.01 n)."""
    while (work := study.next_work()) is not None:
        stop = stop_at.get(work.trial)
        step = min(work.step, stop) if stop is not None else work.step
        status = "early_stopped" if stop is not None and stop <= work.step else (
            "completed" if step == 180 else "paused")
        rung = study.rungs.index(work.step)
        value = (values or {}).get(work.trial, [0.6 + 0.01 * work.trial] * 4)[rung]
        study.record(work, RungResult(run_key=f"r{work.trial}", status=status, step=step, metric="auc", value=value,
                                      last_value=value, billed_seconds=step * 0.01))


def test_the_naive_search_stops_early_too_and_a_cut_trial_costs_its_median_stop(tmp_path: Path) -> None:
    study = _study(tmp_path, patience=2)
    _run(study, stop_at={0: 100})  # the config as given early-stops at step 100
    report = build_report(study)
    rows = {r.number: r for r in report.trials}
    assert rows[0].state == "early_stopped" and any(r.state == "pruned" for r in rows.values())
    finished = sorted(r.steps for r in rows.values() if r.state in ("completed", "early_stopped"))
    median = finished[len(finished) // 2]
    # Each finished trial as it ran; each cut one to the study's median stop (its rungs still
    # improving), never the full train.max_steps a naive count would charge.
    expected = sum(r.steps if r.state != "pruned" else max(r.steps, median) for r in rows.values()) * 0.01
    assert report.naive.seconds == pytest.approx(expected)
    assert report.naive.seconds < len(rows) * 180 * 0.01
    assert report.saved_fraction == pytest.approx(1 - report.spend.seconds / report.naive.seconds)


def test_a_cut_trial_whose_curve_already_stopped_costs_no_more_than_it_ran(tmp_path: Path) -> None:
    # eval_every 20, patience 1: trial 1 peaked at its first rung (20) and fell by the second
    # (60), so the run's own rule would have stopped it there; trials 2 and 3 were cut at their
    # first rung with nothing to go on: the study's median stop (180).
    study = _study(tmp_path, patience=1)
    _run(study, stop_at={}, values={0: [0.7, 0.8, 0.9], 1: [0.9, 0.5, 0.5], 2: [0.6] * 3, 3: [0.6] * 3})
    report = build_report(study)
    assert [(r.state, r.steps) for r in report.trials] == [
        ("completed", 180), ("pruned", 60), ("pruned", 20), ("pruned", 20)]
    assert report.naive.seconds == pytest.approx((180 + 60 + 180 + 180) * 0.01)


def test_a_search_that_cut_nothing_claims_no_saving(tmp_path: Path) -> None:
    study = _study(tmp_path, pruner="none")
    _run(study, stop_at={})
    report = build_report(study)
    assert report.best is not None and not any(r.state in ("pruned", "budget") for r in report.trials)
    assert report.saved_fraction is None


def test_each_trial_is_plotted_at_the_spend_when_its_last_rung_ended(tmp_path: Path) -> None:
    report = build_report(_finished(tmp_path))
    points, _ = curve_points(report)
    waited = [r for r in report.trials if r.state == "pruned"]
    assert waited and all(r.spent_at is not None for r in report.trials)
    # A trial ASHA closed at the study's end is drawn where its work was done, not at the end.
    end = max(r.spent_at or 0.0 for r in report.trials)
    assert any((r.spent_at or 0.0) < end for r in waited)
    assert sorted(x for x, _, _ in points) == [x for x, _, _ in points]


def _finished(tmp_path: Path) -> Study:
    study = _study(tmp_path)
    while (work := study.next_work()) is not None:
        study.record(work, RungResult(run_key=f"r{work.trial}", status="completed" if work.step == 180 else "paused",
                                      step=work.step, metric="auc", value=0.6 + 0.01 * work.trial,
                                      billed_seconds=work.step * 0.01))
    return study


def _difference(low: float) -> PairedDifference:
    return PairedDifference(metric="auc", improvement=low + 0.01, low=low, high=low + 0.02, confidence=0.95,
                            method="DeLong", rows=90)


def test_the_answer_is_the_config_as_given_unless_the_pick_beats_it_beyond_noise(tmp_path: Path) -> None:
    from training.tune.study_report import against_base

    report = build_report(_finished(tmp_path))
    assert report.best is not None and report.best.trial != 0 and report.trials[0].base
    asked: list[tuple[str, str, float]] = []

    def noise(challenger: str, base: str, confidence: float) -> PairedDifference:
        asked.append((challenger, base, confidence))
        return _difference(-0.004)

    kept = against_base(report, noise, 0.95)
    # The pick is the best of the finished trials other than the base: the interval is widened
    # for as many (Bonferroni), so the best of many noisy differences does not win by chance.
    others = sum(1 for r in report.trials if r.state in ("completed", "early_stopped") and not r.base)
    assert others > 1 and asked == [(report.best.run_key, "r0", pytest.approx(1 - 0.05 / others))]
    assert kept.best is not None and kept.best.trial == 0 and kept.best.params == report.trials[0].params
    assert "within noise" in (kept.best.evidence or "") and f"best of {others} trials" in (kept.best.evidence or "")
    beaten = against_base(report, lambda challenger, base, confidence: _difference(0.002))
    assert beaten.best is not None and beaten.best.trial == report.best.trial and "+0.0020" in (beaten.best.evidence or "")


def test_a_study_says_before_any_trial_when_a_trial_takes_hours_on_this_cpu(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from training.config import RetrainConfig
    from training.tune.driver import _warn_of_hours

    with caplog.at_level(logging.WARNING):
        _warn_of_hours(RetrainConfig(), RungCost(startup_seconds=5.0, seconds_per_step=3.1), "cpu")  # the text model
        _warn_of_hours(RetrainConfig(), RungCost(startup_seconds=5.0, seconds_per_step=0.004), "cpu")  # the demo
        _warn_of_hours(RetrainConfig(), RungCost(startup_seconds=5.0, seconds_per_step=3.1), "cuda")
    (warned,) = caplog.records
    assert "about 1.7 h on this machine's CPU (3100 ms a step" in warned.getMessage()
    assert "retrain plan" in warned.getMessage()
