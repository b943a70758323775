"""The study's journal is input from whoever can write the storage root, and from a kill
mid-append: planted trials are refused, a cut last line is repaired, a damaged line is one error
naming it, and a study that spent refuses to start again from nothing."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml

from training.config import load_config
from training.errors import DataError
from training.protocol.results import RungResult
from training.tune.study import RungCost, RungWork, Study
from training.tune.study_report import build_report

SPACE = {"train.optim.lr": "loguniform(1e-4, 1e-2)"}
LR = json.dumps({"name": "FloatDistribution", "attributes": {"step": None, "low": 1e-4, "high": 1e-2, "log": True}})


def _study(tmp_path: Path) -> Study:
    path = tmp_path / "tune.yaml"
    path.write_text(yaml.safe_dump({
        "storage": {"root": str(tmp_path / "root")},
        "train": {"max_steps": 180, "eval_every": 20},
        "tune": {"space": SPACE, "max_trials": 6, "min_resource": 20, "reduction_factor": 3, "pruner": "asha"},
    }))
    return Study(load_config(path), "dataset", RungCost(startup_seconds=0.0, seconds_per_step=0.001))


def _outcome(work: RungWork) -> RungResult:
    value = 0.5 + 0.05 * work.trial + 0.1 * (20, 60, 180).index(work.step)
    return RungResult(run_key=f"run-{work.trial}", status="completed" if work.step == 180 else "paused",
                      step=work.step, metric="auc", value=value, billed_seconds=work.step * 0.001)


def _drive(study: Study, rungs: int | None = None) -> list[RungWork]:
    handed = []
    while (rungs is None or len(handed) < rungs) and (work := study.next_work()) is not None:
        handed.append(work)
        study.record(work, _outcome(work))
    return handed


def _journal(tmp_path: Path) -> Path:
    return next((tmp_path / "root").rglob("journal.log"))


def _append(path: Path, *records: dict) -> None:
    with path.open("a") as f:
        for record in records:
            f.write(json.dumps({"worker_id": "someone-else", **record}) + "\n")


PLANTED = [{"storage.root": "/elsewhere"}, {"model.factory": "builtins:print"},
           {"train.optim.lr": 10.0}, {"train.optim.lr": 0.001, "storage.root": "/elsewhere"}]


@pytest.mark.parametrize("params", PLANTED, ids=["storage.root", "model.factory", "out-of-range", "extra-key"])
def test_a_planted_trial_is_refused_not_trained(tmp_path: Path, params: dict, caplog: pytest.LogCaptureFixture) -> None:
    before = _study(tmp_path)
    _drive(before, rungs=4)
    planted = len(before.trials())  # the number the planted trial gets
    journal = _journal(tmp_path)
    _append(journal, {"op_code": 4, "study_id": 0, "datetime_start": "2026-01-01T00:00:00+00:00", "state": 0,
                      "user_attrs": {"params": json.dumps(params)}})
    with caplog.at_level(logging.WARNING):
        study = _study(tmp_path)
        handed = _drive(study)
    assert planted not in {w.trial for w in handed}
    assert all(w.config.storage.root == str(tmp_path / "root") and w.config.model.factory is None for w in handed)
    assert f"trial {planted} refused" in caplog.text
    rows = {r.number: r for r in build_report(study).trials}
    assert rows[planted].state == "refused" and rows[planted].params == {}
    assert study.complete()


def test_a_param_outside_the_space_set_on_a_running_trial_refuses_that_trial(tmp_path: Path) -> None:
    _drive(_study(tmp_path), rungs=4)  # the base to its end, then trial 1 waits at its first rung
    _append(_journal(tmp_path), {"op_code": 5, "trial_id": 1, "param_name": "storage.root",
                                 "param_value_internal": 0, "distribution": LR})
    study = _study(tmp_path)
    assert study.gate.refused_trials.keys() == {1}
    assert 1 not in {w.trial for w in _drive(study)}


def test_an_unknown_trial_attribute_refuses_the_trial_and_a_bad_spend_is_ignored(tmp_path: Path) -> None:
    first = _study(tmp_path)
    first.add_setup_seconds(5.0, "setup")
    _drive(first, rungs=1)
    _append(_journal(tmp_path),
            {"op_code": 8, "trial_id": 0, "user_attr": {"billed_seconds": -100.0}},
            {"op_code": 2, "study_id": 0, "user_attr": {"setup_seconds": -1e9}},
            {"op_code": 2, "study_id": 0, "user_attr": {"setup_seconds": 1e300}},  # finite, but no study's
            {"op_code": 2, "study_id": 0, "user_attr": {"storage.root": "/elsewhere"}})
    study = _study(tmp_path)
    assert study.gate.refused_trials.keys() == {0}
    assert study.setup_seconds() == {"setup": 5.0}


def test_a_last_line_cut_by_a_kill_is_repaired_and_the_study_finishes_with_its_spend(tmp_path: Path) -> None:
    first = _study(tmp_path)
    first.add_setup_seconds(7.0, "setup")
    _drive(first, rungs=4)
    journal = _journal(tmp_path)
    whole = journal.read_bytes()
    lines = whole.splitlines(keepends=True)
    journal.write_bytes(whole[:-40])  # the last record half-written

    study = _study(tmp_path)
    # Cut back to the last whole line; the study's own open appends after it.
    assert journal.read_bytes().startswith(b"".join(lines[:-1]) + b'{"op_code":0,')
    assert study.setup_seconds() == {"setup": 7.0}
    assert len(study.trials()) >= 2
    _drive(study)
    assert study.complete()
    after = journal.read_bytes()
    assert after.startswith(b"".join(lines[:-1]))
    assert all(json.loads(line) for line in after.splitlines())  # no record glued onto a half line


def test_a_damaged_line_in_the_middle_is_one_error_naming_it(tmp_path: Path) -> None:
    _drive(_study(tmp_path), rungs=2)
    journal = _journal(tmp_path)
    lines = journal.read_bytes().splitlines(keepends=True)
    journal.write_bytes(b"".join([*lines[:4], b"{\"op_code\": 8, garbage\n", *lines[4:]]))
    with pytest.raises(DataError, match=r"journal.log line 5 is not a JSON record.*Restore the file"):
        _study(tmp_path)


@pytest.mark.parametrize("how", ["empty", "missing"])
def test_a_study_that_spent_refuses_an_empty_or_missing_journal(tmp_path: Path, how: str) -> None:
    first = _study(tmp_path)
    _drive(first, rungs=2)
    journal = _journal(tmp_path)
    (journal.parent / "calibration.json").write_text("{}")
    if how == "empty":
        journal.write_bytes(b"")
    else:
        journal.unlink()
    with pytest.raises(DataError, match=rf"journal.log is {how}, but the study recorded spend"):
        _study(tmp_path)


def test_the_best_config_names_its_data_by_absolute_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`retrain run --config best_config.yaml` from another folder trains the same data."""
    from training.tune.study_report import write_report

    monkeypatch.chdir(tmp_path)
    path = tmp_path / "tune.yaml"
    path.write_text(yaml.safe_dump({
        "storage": {"root": "root"}, "data": {"source": "data/mine.parquet", "label": "y"},
        "train": {"max_steps": 180, "eval_every": 20},
        "tune": {"space": SPACE, "max_trials": 2, "min_resource": 20, "reduction_factor": 3, "pruner": "asha"},
    }))
    study = Study(load_config(path), "dataset", RungCost(startup_seconds=0.0, seconds_per_step=0.001))
    _drive(study)
    report, _, _ = write_report(study)
    assert report.best is not None
    best = yaml.safe_load((tmp_path / "root" / study.rel / "best_config.yaml").read_text())
    assert best["data"]["source"] == str(tmp_path / "data" / "mine.parquet")
    assert best["storage"]["root"] == str(tmp_path / "root")


def test_tpes_own_lines_pass_the_gate_once_it_samples_from_the_trials(tmp_path: Path) -> None:
    """Past its startup trials TPE samples jointly and journals that suggestion as trial system
    attributes (tpe:relative_params:<n>): the study's own lines, which must pass."""
    path = tmp_path / "tpe.yaml"
    path.write_text(yaml.safe_dump({
        "storage": {"root": str(tmp_path / "root")}, "train": {"max_steps": 180, "eval_every": 20},
        "tune": {"space": {**SPACE, "model.dropout": "uniform(0, 0.5)"}, "max_trials": 16, "min_resource": 20,
                 "reduction_factor": 3, "pruner": "asha"},
    }))
    study = Study(load_config(path), "dataset", RungCost(startup_seconds=0.0, seconds_per_step=0.001))
    _drive(study)
    assert study.complete() and study.gate.refusals == []
    assert any(k.startswith("tpe:relative_params") for t in study.trials() for k in t.system_attrs)


@pytest.mark.parametrize("planted", [{"seconds_per_step": 1e-300}, {"billed_seconds": 1e300}, {"steps": 7},
                                     {"steps": "20"}, {"extra": 1}, {"startup_seconds": float("nan")}])
def test_a_planted_calibration_is_measured_again(tmp_path: Path, planted: dict, caplog: pytest.LogCaptureFixture) -> None:
    """calibration.json prices every rung until rungs are measured: one that is not what this
    study's calibration writes (free steps, a spend no study has, another step count, a key
    of its own) is not used."""
    from training.tune.trial import Calibration, read_calibration

    path = tmp_path / "calibration.json"
    genuine = {"steps": 20, "billed_seconds": 3.0, "startup_seconds": 1.5, "seconds_per_step": 0.01, "device": "cpu"}
    path.write_text(json.dumps(genuine))
    assert read_calibration(path, 20) == Calibration(**genuine)
    path.write_text(json.dumps({**genuine, **planted}))
    assert read_calibration(path, 20) is None
    assert "calibrating again" in caplog.text
