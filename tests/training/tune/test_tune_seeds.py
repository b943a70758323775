"""Selection that does not reward luck: finished trials rank by their last validation (the best
one is a maximum early stopping took on the same rows), and on a small table the config as given
and the best others are retrained with more seeds, the answer being the best mean. The outcomes
come from tables here; what is tested is what the study trains and what it answers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from training.config import load_config
from training.protocol.results import RungResult
from training.tune.study import RungCost, RungWork, Study
from training.tune.study_report import build_report

MAX_STEPS = 180
# trial -> (best validation, last validation) of its run; trial 0 is the config as given.
FINISHED = {0: (0.80, 0.79), 1: (0.86, 0.78), 2: (0.84, 0.83), 3: (0.82, 0.81)}
# (trial, repeat) -> the last validation of that seed retrain: trial 2's 0.83 was a lucky seed.
SEEDED = {(0, 1): 0.80, (0, 2): 0.78, (2, 1): 0.74, (2, 2): 0.75, (3, 1): 0.82, (3, 2): 0.80}


def _study(tmp_path: Path, train_rows: int | None, **tune: Any) -> Study:
    path = tmp_path / "tune.yaml"
    path.write_text(yaml.safe_dump({
        "storage": {"root": str(tmp_path / "root")}, "train": {"max_steps": MAX_STEPS, "eval_every": 20},
        "tune": {"space": {"train.optim.lr": "loguniform(1e-4, 1e-2)"}, "max_trials": len(FINISHED),
                 "pruner": "none", **tune},
    }))
    return Study(load_config(path), "dataset", RungCost(startup_seconds=0.0, seconds_per_step=0.01),
                 train_rows=train_rows)


def _outcome(work: RungWork) -> RungResult:
    if work.repeat:
        value = SEEDED.get((work.trial, work.repeat), 0.70)
        return RungResult(run_key=f"r{work.trial}-seed{work.repeat}", status="completed", step=MAX_STEPS,
                          metric="auc", value=value + 0.02, last_value=value, billed_seconds=MAX_STEPS * 0.01)
    best, last = FINISHED[work.trial]
    end = work.step == MAX_STEPS
    return RungResult(run_key=f"r{work.trial}", status="completed" if end else "paused", step=work.step,
                      metric="auc", value=best if end else best - 0.05, last_value=last if end else None,
                      billed_seconds=work.step * 0.01)


def _run(study: Study) -> list[RungWork]:
    handed = []
    while (work := study.next_work()) is not None:
        handed.append(work)
        study.record(work, _outcome(work))
    return handed


def test_finished_trials_rank_by_their_last_validation_not_their_best(tmp_path: Path) -> None:
    study = _study(tmp_path, train_rows=50_000)  # a large table: no seed retrains
    assert not any(w.repeat for w in _run(study))
    report = build_report(study)
    # Trial 1 has the best validation of all (0.86) but ended at 0.78: early stopping's maximum.
    assert report.best is not None and report.best.trial == 2 and report.best.score == pytest.approx(0.83)
    assert report.best.value == pytest.approx(0.84)  # what the kept model scores


def test_on_a_small_table_the_base_and_the_best_others_are_retrained_with_two_more_seeds(tmp_path: Path) -> None:
    study = _study(tmp_path, train_rows=800)
    handed = _run(study)
    seeds = [(w.trial, w.repeat, w.config.train.seed, w.step) for w in handed if w.repeat]
    # Once every trial is done: the config as given, then trials 2 and 3 (the best last validations).
    assert seeds == [(0, 1, 1, MAX_STEPS), (0, 2, 2, MAX_STEPS), (2, 1, 1, MAX_STEPS), (2, 2, 2, MAX_STEPS),
                     (3, 1, 1, MAX_STEPS), (3, 2, 2, MAX_STEPS)]
    assert handed.index(next(w for w in handed if w.repeat)) == len(handed) - 6
    report = build_report(study)
    # Trial 2's one seed led; over three seeds trial 3 does (0.81 against 0.773).
    assert report.best is not None and (report.best.trial, report.best.seeds) == (3, 3)
    assert report.best.score == pytest.approx((0.81 + 0.82 + 0.80) / 3)
    rows = {r.number: r for r in report.trials}
    assert rows[2].seed_values == [0.74, 0.75] and rows[1].seed_values == []
    # The retrains are paid for like trials: each run's billed seconds, once.
    assert study.spent_seconds() == pytest.approx((len(FINISHED) + 6) * MAX_STEPS * 0.01)
    # Reopened from its journal, the study has them all: nothing is retrained.
    again = _study(tmp_path, train_rows=800)
    assert again.next_work() is None and build_report(again).best == report.best


def test_a_budget_that_cannot_pay_for_every_seed_retrain_runs_none_and_gives_the_trials_all_of_it(
        tmp_path: Path) -> None:
    study = _study(tmp_path, train_rows=800, seeds=2, max_wall_seconds=len(FINISHED) * 1.8 + 0.5)
    handed = _run(study)
    assert not any(w.repeat for w in handed) and study.seeds_skipped is not None
    assert len(study.trials()) == len(FINISHED)  # nothing was kept back for retrains that could not run
    report = build_report(study)
    assert report.seeds_skipped == study.seeds_skipped and "seed retrains priced at" in study.seeds_skipped
    assert report.best is not None and report.best.seeds == 1 and report.best.trial == 2


def test_a_budget_keeps_back_what_the_seed_retrains_cost(tmp_path: Path) -> None:
    # Room for every trial, or for fewer trials and the retrains: the retrains win.
    study = _study(tmp_path, train_rows=800, max_wall_seconds=2 * 1.8 + 6 * 1.25 * 1.8 + 0.5)
    handed = _run(study)
    # Two trials, their retrains, then a third that the budget left still pays retrains for.
    assert [(w.trial, w.repeat) for w in handed] == [(0, 0), (1, 0), (0, 1), (0, 2), (1, 1), (1, 2), (2, 0), (2, 1),
                                                     (2, 2)]
    assert study.seeds_skipped is None and study.spent_seconds() <= 2 * 1.8 + 6 * 1.25 * 1.8 + 0.5
    report = build_report(study)
    assert report.best is not None and report.best.seeds == 3


def test_the_journal_refuses_a_seed_record_the_study_did_not_write(tmp_path: Path) -> None:
    study = _study(tmp_path, train_rows=800)
    _run(study)
    journal = tmp_path / "root" / study.rel / "journal.log"
    lines = journal.read_text().splitlines()
    seed_lines = [i for i, line in enumerate(lines) if '"seed:' in line]
    assert len(seed_lines) == 6
    forged = json.loads(lines[seed_lines[2]])  # trial 2's first seed, made to win
    forged["user_attr"] = {"seed:2:1": {"run_key": "r2-seed1", "billed_seconds": 1.8, "value": 0.99, "extra": 1}}
    lines[seed_lines[2]] = json.dumps(forged)
    unknown = dict(forged, user_attr={"seed:9:1": {"run_key": "x", "billed_seconds": 1.0, "value": 0.99}})
    journal.write_text("\n".join([*lines, json.dumps(unknown)]) + "\n")
    again = _study(tmp_path, train_rows=800)
    assert (2, 1) not in again.seed_records() and (9, 1) not in again.seed_records()
    assert len(again.gate.refusals) == 2
    # The refused retrain is trained again (its run is found finished), not taken on the journal's word.
    work = again.next_work()
    assert work is not None and (work.trial, work.repeat) == (2, 1)


def test_with_a_seed_retrain_missing_every_trial_ranks_on_its_own_run_alone(tmp_path: Path) -> None:
    _run(_study(tmp_path, train_rows=800))
    journal = tmp_path / "root" / _study(tmp_path, train_rows=800).rel / "journal.log"
    # Trial 3's second retrain never recorded (the flow died before it): its partial mean (0.815)
    # must not be ranked against the others' full means, nor against single seeds.
    journal.write_text("".join(line for line in journal.read_text().splitlines(keepends=True)
                               if '"seed:3:2"' not in line))
    report = build_report(_study(tmp_path, train_rows=800))
    assert report.best is not None and (report.best.trial, report.best.seeds) == (2, 1)
    assert report.best.score == pytest.approx(0.83)


def test_under_asha_the_seed_retrains_are_kept_back_before_the_search_widens(tmp_path: Path) -> None:
    """ASHA finishes trials last (promotions wait for the rung to fill): without a reserve from
    the first few trials on, 30 first rungs and their promotions spend what the retrains need."""
    study = _study(tmp_path, train_rows=800, pruner="asha", max_trials=30, min_resource=20, reduction_factor=3,
                   max_wall_seconds=22.0)

    def outcome(work: RungWork) -> RungResult:
        value = 0.7 + 0.001 * ((work.trial * 7) % 30) + 0.0001 * work.repeat
        end = work.step == MAX_STEPS
        return RungResult(run_key=f"r{work.trial}-{work.repeat}", status="completed" if end else "paused",
                          step=work.step, metric="auc", value=value, last_value=value if end else None,
                          billed_seconds=work.step * 0.01)

    handed = []
    while (work := study.next_work()) is not None:
        handed.append(work)
        study.record(work, outcome(work))
    assert study.seeds_skipped is None, study.seeds_skipped
    assert sum(1 for w in handed if w.repeat) == 6  # three candidates, two more seeds each
    assert len(study.trials()) < 30 and study.spent_seconds() <= 22.0
    report = build_report(study)
    assert report.best is not None and report.best.seeds == 3
