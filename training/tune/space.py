"""The search space of `tune.space`: dotted config keys with a distribution each, parsed into
Optuna distributions, validated like the rest of the config, and applied to make a trial's config.

    train.lr: loguniform(1e-4, 1e-2)      float, log scale
    model.dropout: uniform(0, 0.5)        float
    train.grad_accum: int(1, 4)           integer, inclusive
    train.batch_size: logint(64, 1024)    integer, log scale
    model.hidden: choice([[128, 64], [256, 128]])   any YAML values

Only COMPUTED model.* and train.* keys can be tuned: trials share one packed dataset and one
preprocessing result, and an operational key (device, retries, ...) would make every trial the
same run. `train.max_steps` is the resource the pruner allots, and `train.eval_every` sets the
rungs, so neither is a search dimension.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution

    from training.config import RetrainConfig

__all__ = ["Dimension", "parse_space", "check_space", "apply_params", "SpaceError"]

_FORM = re.compile(r"^\s*(loguniform|uniform|logint|int|choice)\s*\((.*)\)\s*$", re.DOTALL)
_TUNABLE_SECTIONS = ("model", "train")
_NOT_TUNABLE = {"train.max_steps": "it is the resource the pruner allots (full fidelity)",
                "train.eval_every": "it sets where the rungs are (tune.min_resource is a multiple of it)"}


class SpaceError(ValueError):
    """One bad entry of tune.space; the message names its key."""


@dataclass(frozen=True)
class Dimension:
    """One entry of the space. Choices travel through Optuna as JSON strings, so any YAML value
    (a list of widths, a null) can be a choice."""

    key: str
    kind: str  # loguniform, uniform, int, logint, choice
    low: float = 0.0
    high: float = 0.0
    choices: tuple[str, ...] = ()

    def distribution(self) -> BaseDistribution:
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        if self.kind == "choice":
            return CategoricalDistribution(list(self.choices))
        if self.kind in ("int", "logint"):
            return IntDistribution(int(self.low), int(self.high), log=self.kind == "logint")
        return FloatDistribution(self.low, self.high, log=self.kind == "loguniform")

    def value(self, raw: Any) -> Any:
        """The config value of an Optuna parameter value."""
        return json.loads(raw) if self.kind == "choice" else raw

    def extremes(self) -> list[Any]:
        """Values that prove the whole range valid for the key: the bounds, or every choice."""
        if self.kind == "choice":
            return [json.loads(c) for c in self.choices]
        if self.kind in ("int", "logint"):
            return [int(self.low), int(self.high)]
        return [self.low, self.high]


def _number(value: Any) -> Any:
    """YAML reads 1e-4 (no dot) as a string; in a bound it is a number."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _parse(key: str, text: str) -> Dimension:
    match = _FORM.match(str(text))
    if match is None:
        raise SpaceError(f"tune.space.{key}: {text!r} is not a distribution; write loguniform(lo, hi), "
                         "uniform(lo, hi), int(lo, hi), logint(lo, hi) or choice([a, b, ...])")
    kind, args = match.groups()
    try:
        parsed = yaml.safe_load(f"[{args}]")
    except yaml.YAMLError:
        raise SpaceError(f"tune.space.{key}: cannot parse the arguments of {text!r}") from None
    if kind == "choice":
        if len(parsed) != 1 or not isinstance(parsed[0], list) or not parsed[0]:
            raise SpaceError(f"tune.space.{key}: choice takes one non-empty list, e.g. choice([64, 128])")
        choices = [json.dumps(v, sort_keys=True) for v in parsed[0]]
        if len(set(choices)) != len(choices):
            raise SpaceError(f"tune.space.{key}: choice lists a value twice")
        return Dimension(key, kind, choices=tuple(choices))
    parsed = [_number(v) for v in parsed]
    if len(parsed) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in parsed):
        raise SpaceError(f"tune.space.{key}: {kind} takes two numbers (low, high), got {args.strip()!r}")
    low, high = float(parsed[0]), float(parsed[1])
    if kind in ("int", "logint") and not (low.is_integer() and high.is_integer()):
        raise SpaceError(f"tune.space.{key}: {kind} bounds must be integers, got {args.strip()!r}")
    if not low < high:
        raise SpaceError(f"tune.space.{key}: low must be below high, got {args.strip()!r}")
    if kind.startswith("log") and low <= 0:
        raise SpaceError(f"tune.space.{key}: {kind} needs low > 0, got {args.strip()!r}")
    return Dimension(key, kind, low, high)


def _check_key(config: RetrainConfig, key: str) -> None:
    from training.config import is_computed

    section, _, name = key.partition(".")
    if section not in type(config).model_fields or not isinstance(getattr(config, section), BaseModel):
        raise SpaceError(f"tune.space.{key}: not a config key (tunable: model.* and train.* keys)")
    if section not in _TUNABLE_SECTIONS:
        raise SpaceError(f"tune.space.{key}: only model.* and train.* keys can be tuned; trials share one packed "
                         "dataset and one preprocessing result")
    model = getattr(config, section)
    if name not in type(model).model_fields:
        raise SpaceError(f"tune.space.{key}: {section} has no key {name!r}")
    if key in _NOT_TUNABLE:
        raise SpaceError(f"tune.space.{key}: cannot be tuned: {_NOT_TUNABLE[key]}")
    if not is_computed(type(model), name):
        raise SpaceError(f"tune.space.{key}: an operational key (it does not change what a trial computes, so "
                         "every trial would be the same run)")


def parse_space(space: dict[str, str]) -> list[Dimension]:
    """The space's dimensions, in key order (so the same space samples the same way)."""
    return [_parse(key, space[key]) for key in sorted(space)]


def apply_params(config: RetrainConfig, params: dict[str, Any]) -> RetrainConfig:
    """`config` with each dotted key set to its (config-side) value, validated."""
    from training.config import validate_config

    raw = config.model_dump(mode="json", exclude={"tune"})
    for key, value in params.items():
        section, _, name = key.partition(".")
        raw[section][name] = value
    return validate_config({**raw, "tune": config.tune.model_dump(mode="json")}, f"(tuning trial {params})")


def check_space(config: RetrainConfig) -> None:
    """Every entry parses, names a tunable key, and every value of its range makes a valid config;
    the rungs fit train.eval_every and train.max_steps. Raises SpaceError naming the key."""
    from training.errors import ConfigError

    for dim in parse_space(config.tune.space):
        _check_key(config, dim.key)
        section, _, name = dim.key.partition(".")
        for value in dim.extremes():
            raw = config.model_dump(mode="json", exclude={"tune"})
            raw[section][name] = value
            try:
                type(config).model_validate(raw)
            except ValueError as err:
                detail = str(err.errors()[0]["msg"]) if hasattr(err, "errors") else str(err)
                raise SpaceError(f"tune.space.{dim.key}: {value!r} is not a valid value: "
                                 f"{detail.removeprefix('Value error, ')}") from None
            except ConfigError as err:
                raise SpaceError(f"tune.space.{dim.key}: {value!r} is not a valid value: {err}") from None
    t, every, last = config.tune, config.train.eval_every, config.train.max_steps
    if t.min_resource is not None and (t.min_resource % every or t.min_resource >= last):
        raise SpaceError(f"tune.min_resource ({t.min_resource}) must be a multiple of train.eval_every ({every}) "
                         f"and below train.max_steps ({last}): a trial reports at validated steps")
    if t.pruner != "none" and len(config.rungs()) < 2:
        raise SpaceError(f"tune.pruner {t.pruner} needs at least two rungs: train.max_steps ({last}) is too short for "
                         f"train.eval_every ({every}) x tune.reduction_factor ({t.reduction_factor}); set "
                         "tune.min_resource or tune.pruner: none")
