"""A model too large for this machine is refused before training, naming the key to change."""

from __future__ import annotations

import pytest
import torch

from training.config import load_config
from training.errors import ConfigError
from training.model.memory_fit import available_bytes, check_model_fits, check_space_fits
from training.model.network import ModelSchema

SCHEMA = ModelSchema(task="binary", n_outputs=1, numeric=["a", "b"], categorical=["c"], cardinalities=[50],
                     numeric_bins=[[-1.0, 0.0, 1.0]] * 2)
CPU = torch.device("cpu")


def test_the_default_model_fits_and_a_huge_one_is_refused_naming_model_hidden() -> None:
    assert available_bytes(CPU) is not None
    check_model_fits(load_config(), SCHEMA, CPU)
    # Numerics as they are: 2 + 16 embedded inputs, so the count below is the MLP's, by hand.
    huge = load_config(overrides=["model.hidden=[2000000, 2000000]", "model.numeric_embedding=none"])
    with pytest.raises(ConfigError, match=r"does not fit in memory: 4,000,042,000,801 parameters .* lower model.hidden"):
        check_model_fits(huge, SCHEMA, CPU)


def test_a_tune_space_whose_largest_trial_cannot_fit_is_refused_naming_its_key() -> None:
    fits = load_config(overrides=["tune.space={model.hidden: 'choice([[32], [64, 32]])', train.optim.lr: 'uniform(0.001, 0.01)'}"])
    check_space_fits(fits, SCHEMA, CPU)
    too_large = load_config(overrides=["tune.space={model.hidden: 'choice([[32], [2000000, 2000000]])'}"])
    with pytest.raises(ConfigError, match=r"tune.space.model.hidden \(its value \[2000000, 2000000\]\)"):
        check_space_fits(too_large, SCHEMA, CPU)
