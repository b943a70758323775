"""tune.space and the rungs: validated like the rest of the config, one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from training.config import load_config
from training.errors import ConfigError
from training.search_space import parse_space


def _config(tmp_path: Path, tune: dict, train: dict | None = None):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"train": {"max_steps": 360, "eval_every": 40, **(train or {})}, "tune": tune}))
    return load_config(path)


@pytest.mark.parametrize(("space", "named"), [
    ({"train.lrr": "loguniform(1e-4, 1e-2)"}, "tune.space.train.lrr: train has no key 'lrr'"),
    ({"optimizer.lr": "uniform(0, 1)"}, "tune.space.optimizer.lr: not a config key"),
    ({"data.label": "choice([a, b])"}, "tune.space.data.label: only model.* and train.* keys"),
    ({"train.device": "choice([cpu, cuda])"}, "tune.space.train.device: an operational key"),
    ({"train.max_steps": "int(10, 100)"}, "tune.space.train.max_steps: cannot be tuned"),
    ({"train.optim.lr": "normal(0, 1)"}, "tune.space.train.optim.lr: 'normal(0, 1)' is not a distribution"),
    ({"train.optim.lr": "loguniform(0, 1e-2)"}, "tune.space.train.optim.lr: loguniform needs low > 0"),
    ({"train.optim.lr": "uniform(0.1, 0.01)"}, "tune.space.train.optim.lr: low must be below high"),
    ({"train.grad_accum": "int(1.5, 4)"}, "tune.space.train.grad_accum: int bounds must be integers"),
    ({"model.dropout": "uniform(0, 1.5)"}, "tune.space.model.dropout: 1.5 is not a valid value"),
    ({"model.hidden": "choice([])"}, "tune.space.model.hidden: choice takes one non-empty list"),
    ({"model.hidden": "choice([[32], [0]])"}, "tune.space.model.hidden: [0] is not a valid value"),
])
def test_a_bad_space_entry_is_one_line_naming_its_key(tmp_path: Path, space: dict, named: str) -> None:
    with pytest.raises(ConfigError) as err:
        _config(tmp_path, {"space": space})
    message = str(err.value)
    assert named in message and "\n" not in message, message


def test_rungs_fit_the_validation_steps(tmp_path: Path) -> None:
    from training.search_space import SpaceError
    from training.tune.rungs import check_rungs, rungs

    space = {"train.optim.lr": "loguniform(1e-4, 1e-2)"}
    assert rungs(_config(tmp_path, {"space": space, "min_resource": 40, "reduction_factor": 3})) == [40, 120, 360]
    # Default: a fifth of max_steps, down to a multiple of eval_every, then doubling.
    assert rungs(_config(tmp_path, {"space": space})) == [40, 80, 160, 320, 360]
    assert rungs(_config(tmp_path, {"space": space}, {"max_steps": 540, "eval_every": 20})) == [100, 200, 400, 540]
    assert rungs(_config(tmp_path, {"space": space, "pruner": "none"})) == [360]
    with pytest.raises(SpaceError, match=r"tune.min_resource \(50\) must be a multiple of train.eval_every"):
        check_rungs(_config(tmp_path, {"space": space, "min_resource": 50}))
    with pytest.raises(SpaceError, match="needs at least two rungs"):
        check_rungs(_config(tmp_path, {"space": space}, {"max_steps": 40}))


def test_a_trial_config_carries_its_parameters(tmp_path: Path) -> None:
    config = _config(tmp_path, {"space": {"train.optim.lr": "loguniform(1e-4, 1e-2)", "model.hidden": "choice([[32], [64, 16]])",
                                          "train.grad_accum": "int(1, 4)"}})
    dims = {d.key: d for d in parse_space(config.tune.space)}
    assert dims["model.hidden"].distribution().choices == ("[32]", "[64, 16]")
    trial = config.with_values({"train.optim.lr": 0.005, "model.hidden": [64, 16], "train.grad_accum": 3}, "(tuning trial)")
    assert (trial.train.optim.lr, trial.model.hidden, trial.train.grad_accum) == (0.005, [64, 16], 3)
    assert trial.storage == config.storage and trial.tune == config.tune
