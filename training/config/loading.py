"""A run configuration from YAML and `dotted.key=value` overrides, validated with every problem
in one `ConfigError`; and a deployment's parameters merged under a run's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from training.config.problems import format_errors
from training.config.schema import RetrainConfig
from training.errors import ConfigError

__all__ = ["apply_overrides", "load_config", "merge_over", "validate_config"]


def validate_config(raw: dict[str, Any], origin: str = "") -> RetrainConfig:
    """Build the config from a plain mapping, collecting every problem into one error."""
    try:
        return RetrainConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(format_errors(err, origin or "(from --set)", RetrainConfig)) from None


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `dotted.key=value` overrides; values parse as YAML scalars or lists."""
    out = json.loads(json.dumps(raw))
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected dotted.key=value, e.g. --set train.batch_size=256")
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            raise ConfigError(f"--set {key}: cannot parse {text!r} as a YAML value") from None
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {key}: '{part}' is a value, not a section")
            node = child
        node[parts[-1]] = value
    return out


def merge_over(base: dict[str, Any], config: RetrainConfig) -> RetrainConfig:
    """`config` with every key it was not explicitly given taken from `base` (deep, per key).

    Prefect merges a run's parameters over its deployment's shallowly, so a run given
    `config={"train": {"max_steps": 500}}` would otherwise lose the deployment's storage root and
    everything else. pydantic records which fields were given (`exclude_unset`), so defaults
    never override the deployment's values.
    """
    given = config.model_dump(mode="json", exclude_unset=True)
    return validate_config(_deep_merge(base, given), "(deployment parameters merged with the run's)")


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RetrainConfig:
    """Read YAML (optional), apply overrides, validate; every problem in one `ConfigError`."""
    raw: dict[str, Any] = {}
    origin = ""
    if path is not None:
        p = Path(path)
        origin = f"in {p}"
        try:
            loaded = yaml.safe_load(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {p} does not exist") from None
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"config file {p} is not valid YAML{where}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections (data, train, ...)")
        raw = loaded
    raw = apply_overrides(raw, overrides or [])
    return validate_config(raw, origin)
