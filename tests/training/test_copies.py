"""A copy with changes is validated as a new value: pydantic's model_copy(update=...) takes a
wrong type, a refused value and a field that does not exist, silently."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from training.config import RetrainConfig
from training.copies import updated
from training.pipeline.handoffs import PrepResult


def test_a_copy_refuses_what_model_copy_takes() -> None:
    train = RetrainConfig().train
    # What model_copy does, and why the helper exists.
    assert train.model_copy(update={"max_steps": "lots", "typo": 3}).max_steps == "lots"
    with pytest.raises(ValidationError, match="max_steps"):
        updated(train, {"max_steps": "lots"})
    with pytest.raises(ValidationError, match="batch_size"):
        updated(train, {"batch_size": 0})  # the field's own bound
    with pytest.raises(TypeError, match="'typo'"):
        updated(train, {"typo": 3})
    with pytest.raises(TypeError, match="'typo'"):  # a record that ignores unknown keys when it reads a file
        updated(PrepResult(stats_path="s", stats_rel="r", reused=False, key="k", code_version=1, cardinalities=[],
                           seconds=0.0), {"typo": 1})


def test_a_copy_keeps_its_values_and_which_of_them_were_given() -> None:
    config = RetrainConfig.model_validate({"data": {"label": "clicked"}, "train": {"max_steps": 300}})
    copy = updated(config, {"train": updated(config.train, {"max_steps": 400})})
    assert copy.train.max_steps == 400 and copy.data.label == "clicked"
    assert copy.data.model_fields_set == config.data.model_fields_set  # a default is still a default
    assert copy.model_dump(exclude={"train"}) == config.model_dump(exclude={"train"})


def test_a_copy_keeps_a_default_section_changed_in_place() -> None:
    config = RetrainConfig()
    config.budget.max_wall_seconds = 20.0  # the section was a default, then set
    copy = updated(config, {"train": updated(config.train, {"max_steps": 10})})
    assert copy.budget.max_wall_seconds == 20.0 and copy.train.max_steps == 10
