"""tune.pruner asha: Li et al.'s promotion rule, decided from the journal alone, so a study
reopened after a kill hands out exactly the work it would have. The rungs' values come from a
table here: what is tested is which trial the study trains next, not the training (the e2e
tune tests train real trials)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from training.config import load_config
from training.protocol.results import RungResult
from training.tune.study import RungCost, RungWork, Study

RUNGS = (20, 60, 180)
AT_FIRST_RUNG = (0.50, 0.70, 0.60, 0.80, 0.55, 0.65, 0.52, 0.75, 0.58)  # trial number -> value at step 20

# Worked by hand from the rule (reduction factor 3). Trial 0 is the config as given (the space
# holds its learning rate): it is never pruned and goes on first, so the study always holds the
# run it must beat. Then a trial goes on only once it is in the top third of the trials that
# reached its rung (trial 0's values count among them): trial 1 once three trials reached step
# 20, trial 3 to step 180 once it leads three at step 60.
EXPECTED_WORK = [(0, 20), (0, 60), (0, 180), (1, 20), (2, 20), (1, 60), (3, 20), (3, 60), (3, 180), (4, 20),
                 (5, 20), (6, 20), (7, 20), (7, 60), (8, 20)]


def _study(tmp_path: Path, pruner: str = "asha", low: float = 1e-4) -> Study:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "tune.yaml"
    path.write_text(yaml.safe_dump({
        "storage": {"root": str(tmp_path / "root")},
        "train": {"max_steps": 180, "eval_every": 20},
        "tune": {"space": {"train.optim.lr": f"loguniform({low}, 1e-2)"}, "max_trials": len(AT_FIRST_RUNG),
                 "min_resource": 20, "reduction_factor": 3, "pruner": pruner},
    }))
    return Study(load_config(path), "dataset", RungCost(startup_seconds=0.0, seconds_per_step=0.001))


def _outcome(work: RungWork) -> RungResult:
    value = AT_FIRST_RUNG[work.trial] + 0.1 * RUNGS.index(work.step)
    return RungResult(run_key=f"run-{work.trial}", status="completed" if work.step == RUNGS[-1] else "paused",
                      step=work.step, metric="auc", value=value, billed_seconds=work.step * 0.001)


def _final(study: Study) -> list[tuple[int, str, int | None, str | None]]:
    return [(t.number, t.state.name, t.user_attrs.get("steps"), t.user_attrs.get("status")) for t in study.trials()]


def _drive(study: Study, reopen_before: set[int] = frozenset(), tmp_path: Path | None = None) -> list[tuple[int, int]]:
    """Train the study's work one rung at a time; before recording the i-th outcome in
    `reopen_before`, lose the study (a kill mid-rung) and open it again from its journal."""
    handed: list[tuple[int, int]] = []
    while (work := study.next_work()) is not None:
        handed.append((work.trial, work.step))
        if len(handed) - 1 in reopen_before:
            assert tmp_path is not None
            study = _study(tmp_path)
            again = study.next_work()
            assert again is not None and (again.trial, again.step) == (work.trial, work.step)
            work = again
        study.record(work, _outcome(work))
    return handed


def test_asha_promotes_a_trial_only_once_it_is_in_the_top_of_its_rung(tmp_path: Path) -> None:
    study = _study(tmp_path)
    assert _drive(study) == EXPECTED_WORK
    final = _final(study)
    # Nothing is left RUNNING: trials still waiting at a rung when the study ends are pruned there.
    assert final == [(0, "COMPLETE", 180, "completed"), (1, "PRUNED", 60, "pruned"), (2, "PRUNED", 20, "pruned"),
                     (3, "COMPLETE", 180, "completed"), (4, "PRUNED", 20, "pruned"), (5, "PRUNED", 20, "pruned"),
                     (6, "PRUNED", 20, "pruned"), (7, "PRUNED", 60, "pruned"), (8, "PRUNED", 20, "pruned")]
    assert study.complete()


def test_optuna_sh_promotes_the_first_trial_unconditionally(tmp_path: Path) -> None:
    # The contrast the asha rule exists for, on a space without the config's own learning rate
    # (so no base trial): Optuna's pruner sends trial 0 to the top rung, asha does not.
    handed = _drive(_study(tmp_path / "sh", pruner="optuna_sh", low=5e-3))
    assert handed[:3] == [(0, 20), (0, 60), (0, 180)]
    assert _drive(_study(tmp_path / "asha", low=5e-3))[:3] == [(0, 20), (1, 20), (2, 20)]


@pytest.mark.parametrize("kill_at", [0, 3, 5, 10, 11, 12])
def test_a_reopened_study_hands_out_the_same_work(tmp_path: Path, kill_at: int) -> None:
    study = _study(tmp_path)
    assert _drive(study, reopen_before={kill_at}, tmp_path=tmp_path) == EXPECTED_WORK
    assert [state for _, state, _, _ in _final(_study(tmp_path))].count("COMPLETE") == 2  # the base and the winner


BUDGETED_RUNGS = (20, 60, 180, 540)


def _budgeted(tmp_path: Path, max_wall_seconds: float, low: float = 1e-4) -> Study:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "budgeted.yaml"
    path.write_text(yaml.safe_dump({
        "storage": {"root": str(tmp_path / "budgeted")},
        "train": {"max_steps": BUDGETED_RUNGS[-1], "eval_every": 20},
        "tune": {"space": {"train.optim.lr": f"loguniform({low}, 1e-2)"}, "max_trials": 40, "min_resource": 20,
                 "reduction_factor": 3, "pruner": "asha", "max_wall_seconds": max_wall_seconds},
    }))
    return Study(load_config(path), "dataset", RungCost(startup_seconds=0.0, seconds_per_step=0.001))


def _budgeted_outcome(work: RungWork) -> RungResult:
    value = 0.5 + (work.trial * 7 % 10) / 40 + 0.1 * BUDGETED_RUNGS.index(work.step)
    return RungResult(run_key=f"run-{work.trial}", status="completed" if work.step == BUDGETED_RUNGS[-1] else "paused",
                      step=work.step, metric="auc", value=value, billed_seconds=work.step * 0.001)


def test_the_first_trial_is_the_config_as_given_when_the_space_holds_it(tmp_path: Path) -> None:
    study = _budgeted(tmp_path / "held", 10.0)
    work = study.next_work()
    assert work is not None and work.params == {"train.optim.lr": study.config.train.optim.lr}
    study = _budgeted(tmp_path / "outside", 10.0, low=5e-3)
    assert study.config.train.optim.lr < 5e-3
    work = study.next_work()
    assert work is not None and 5e-3 <= work.params["train.optim.lr"] <= 1e-2  # sampled: the space lacks it


def test_a_budget_keeps_what_the_leading_trial_needs_to_reach_full_fidelity(tmp_path: Path) -> None:
    # ASHA trains a trial to step 540 once 27 trials reached step 20, 9 step 60 and 3 step 180:
    # 1.62 machine-s here. A 0.8 s budget spent that way would end with every trial pruned; the
    # study stops starting trials while the leader's way to step 540 needs what is left, so it
    # ends with a trial trained to the end, within its budget.
    study = _budgeted(tmp_path, 0.8)
    while (work := study.next_work()) is not None:
        study.record(work, _budgeted_outcome(work))
    finished = [t for t in study.trials() if t.state.name == "COMPLETE"]
    assert finished and all(t.user_attrs["steps"] == BUDGETED_RUNGS[-1] for t in finished)
    assert study.spent_seconds() <= 0.8 + 1e-9
    assert study.stopped_by is not None and "tune.max_wall_seconds" in study.stopped_by
