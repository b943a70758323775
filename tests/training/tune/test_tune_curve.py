"""The tune curve follows the study in time: an ASHA study finishes its trials out of the order
of their numbers, and the curve must not pretend otherwise."""

from __future__ import annotations

from pathlib import Path

from training.tune.study_report import Spend, StudyBudget, TrialRow, TuneReport, _plot, curve_points


def _row(number: int, state: str, value: float, finished_at: str | None, seconds: float) -> TrialRow:
    return TrialRow(number=number, params={}, state=state, rung=0, steps=10, value=value, rung_values={},
                    billed_seconds=seconds, usd=0.0, gpu_hours=0.0, steps_lost=0, preemptions=0, run_key=None,
                    finished_at=finished_at)


def _report(trials: list[TrialRow]) -> TuneReport:
    spend = Spend(seconds=0.0, usd=0.0, gpu_hours=0.0, setup_seconds={"calibration": 10.0})
    return TuneReport(study="s", status="complete", stop_reason=None, metric="auc", direction="maximize", rungs=[10],
                      instance_type="local-cpu", market="on_demand", rate_per_hour=3600.0, trials=trials, spend=spend,
                      budget=StudyBudget(), naive=spend, saved_fraction=None, best=None)


def test_trials_are_plotted_in_the_order_they_finished(tmp_path: Path) -> None:
    # Trial 0 reached full fidelity last; trial 2 is still open.
    report = _report([_row(0, "completed", 0.80, "2026-11-27T10:05:00", 5.0),
                      _row(1, "pruned", 0.60, "2026-11-27T10:01:00", 1.0),
                      _row(2, "running", 0.70, None, 2.0),
                      _row(3, "completed", 0.75, "2026-11-27T10:02:00", 3.0)])
    points, best = curve_points(report)
    # $1 per second: setup $10, then trial 1 ($1), trial 3 ($3), trial 0 ($5), then the open trial 2 ($2).
    assert points == [(11.0, 0.60, "pruned"), (14.0, 0.75, "completed"), (19.0, 0.80, "completed"),
                      (21.0, 0.70, "running")]
    assert best == [(14.0, 0.75), (19.0, 0.80), (21.0, 0.80)]
    _plot(report, tmp_path / "tune_curve.png")
    assert (tmp_path / "tune_curve.png").read_bytes()[:4] == b"\x89PNG"
