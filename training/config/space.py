"""tune.space checked against the schema: each entry names a COMPUTED model.* or train.* key,
and every value of its range makes a valid config. The rungs, which depend on the data once
train.eval_every is auto, are the tuner's (`training.tune.rungs`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from training.config.marks import is_computed
from training.search_space import SpaceError, parse_space

# The config is typed Any here: it is a RetrainConfig, whose module imports this one.
RetrainConfig = Any

__all__ = ["check_space"]


def check_space(config: RetrainConfig) -> None:
    """Every entry of tune.space parses, names a tunable key, and every value of its range
    makes a valid config (a SpaceError names the entry)."""
    for dim in parse_space(config.tune.space):
        _check_tunable(config, dim.key)
        for value in dim.extremes():
            try:  # without the tune section: the trial's own space check is this one
                type(config).model_validate(config.raw_with({dim.key: value}))
            except ValidationError as err:
                detail = str(err.errors()[0]["msg"]).removeprefix("Value error, ")
                raise SpaceError(f"tune.space.{dim.key}: {value!r} is not a valid value: {detail}") from None


# Keys a tuning study cannot search, and why.
_TUNABLE_SECTIONS = ("model", "train")
_NOT_TUNABLE = {"train.max_steps": "it is the resource the pruner allots (full fidelity)",
                "train.eval_every": "it sets where the rungs are (tune.min_resource is a multiple of it)"}


def _check_tunable(config: RetrainConfig, key: str) -> None:
    """A tune.space key must be a COMPUTED model.* or train.* key (sections included)."""
    section, *path = key.split(".")
    if section not in type(config).model_fields or not path:
        raise SpaceError(f"tune.space.{key}: not a config key (tunable: model.* and train.* keys)")
    if section not in _TUNABLE_SECTIONS:
        raise SpaceError(f"tune.space.{key}: only model.* and train.* keys can be tuned; trials share one packed "
                         "dataset and one preprocessing result")
    if key in _NOT_TUNABLE:
        raise SpaceError(f"tune.space.{key}: cannot be tuned: {_NOT_TUNABLE[key]}")
    node: BaseModel = getattr(config, section)
    for i, name in enumerate(path):
        if name not in type(node).model_fields:
            where = ".".join([section, *path[:i]])
            raise SpaceError(f"tune.space.{key}: {where} has no key {name!r}")
        if not is_computed(type(node), name):
            raise SpaceError(f"tune.space.{key}: an operational key (it does not change what a trial computes, so "
                             "every trial would be the same run)")
        child = getattr(node, name)
        if i < len(path) - 1:
            if not isinstance(child, BaseModel):
                raise SpaceError(f"tune.space.{key}: {name} is a value, not a section")
            node = child


