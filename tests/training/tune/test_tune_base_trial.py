"""The study's base trial is the config as given: the same run as `retrain run` of that config."""

from __future__ import annotations

from pathlib import Path

import yaml

from training.config import load_config
from training.pipeline.train_stage import run_key_for
from training.tune.study import RungCost, Study


def test_the_base_trial_trains_the_run_key_of_retrain_run_so_a_finished_run_is_reused(tmp_path: Path) -> None:
    """train.eval_every and train.patience are `auto`: the study resolves them for its rungs,
    and a trial built from the resolved config had another run key than `retrain run`'s, so
    an identical finished run was trained again."""
    path = tmp_path / "tune.yaml"
    path.write_text(yaml.safe_dump({
        "storage": {"root": str(tmp_path / "root")}, "train": {"max_steps": 400},
        "tune": {"space": {"train.optim.lr": "loguniform(1e-4, 1e-2)"}, "max_trials": 4},
    }))
    given = load_config(path)
    assert given.train.eval_every == "auto" and given.train.patience == "auto"
    resolved = given.for_train_rows(10_000)
    study = Study(resolved, "dataset", RungCost(startup_seconds=0.0, seconds_per_step=0.01), given)
    work = study.next_work()
    assert work is not None and work.trial == 0 and work.params == {"train.optim.lr": given.train.optim.lr}
    assert run_key_for(work.config, "dataset") == run_key_for(given, "dataset")
    assert study.rungs == [80, 160, 320, 400]  # the rungs are the resolved interval's (every 20 steps)
