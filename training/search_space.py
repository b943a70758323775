"""The syntax of `tune.space`: dotted config keys with a distribution each, parsed into
Optuna distributions. Which keys may be tuned, and whether every value of a range makes a valid
config, the config checks (`training.config`, which holds the keys).

    train.optim.lr: loguniform(1e-4, 1e-2)      float, log scale
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
from pydantic import JsonValue

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution

__all__ = ["Dimension", "parse_space", "SpaceError", "TrialParams"]

# A trial's parameters: each tuned key's config value (a choice may be any YAML value).
TrialParams = dict[str, JsonValue]

_FORM = re.compile(r"^\s*(loguniform|uniform|logint|int|choice)\s*\((.*)\)\s*$", re.DOTALL)
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

    def value(self, raw: Any) -> JsonValue:
        """The config value of an Optuna parameter value."""
        return json.loads(raw) if self.kind == "choice" else raw

    def param_of(self, value: Any) -> Any | None:
        """The Optuna parameter value of a config value, or None when the space does not hold it."""
        if self.kind == "choice":
            raw = json.dumps(value, sort_keys=True)
            return raw if raw in self.choices else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not self.low <= value <= self.high:
            return None
        if self.kind in ("int", "logint"):
            return int(value) if float(value).is_integer() else None
        return float(value)

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


def parse_space(space: dict[str, str]) -> list[Dimension]:
    """The space's dimensions, in key order (so the same space samples the same way)."""
    return [_parse(key, space[key]) for key in sorted(space)]
