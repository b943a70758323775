"""A failed validation as one line that says how to fix it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from training.config.legacy import MOVED_TRAIN_KEYS, RETIRED_KEYS

__all__ = ["closest_key", "format_errors"]


def closest_key(root: type[BaseModel], loc: tuple[Any, ...]) -> str | None:
    """The known key nearest to an unknown one in the same section (`train.max_step` ->
    `train.max_steps`), or None when nothing is close."""
    import difflib
    import typing

    model: Any = root
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(str(part))
        if field is None:
            return None
        candidates = [field.annotation, *typing.get_args(field.annotation)]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return None
    names = list(getattr(model, "model_fields", {}))
    near = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.6)
    return ".".join([*map(str, loc[:-1]), near[0]]) if near else None


def format_errors(err: ValidationError, origin: str, root: type[BaseModel]) -> str:
    """Every problem of a validation, on one line: a moved key names its new place, an unknown one
    the nearest known key of its section."""
    problems = []
    for e in err.errors():
        loc, kind, msg = e["loc"], e["type"], e["msg"].removeprefix("Value error, ")
        key = ".".join(str(p) for p in loc)
        moved = MOVED_TRAIN_KEYS.get(str(loc[1])) if len(loc) == 2 and loc[0] == "train" else None
        if not key:  # a check across sections: its message names its keys
            problems.append(msg)
        elif kind == "extra_forbidden" and key in RETIRED_KEYS:
            problems.append(f"'{key}' is no longer a setting: {RETIRED_KEYS[key]}")
        elif kind == "extra_forbidden" and moved:
            problems.append(f"'{key}' has moved to 'train.{moved}'")
        elif kind == "extra_forbidden":
            near = closest_key(root, loc)
            problems.append(f"unknown key '{key}'" + (f"; did you mean '{near}'?" if near else ""))
        else:
            got = e.get("input")
            shown = "" if isinstance(got, dict) or got is None else f" (got {got!r})"
            problems.append(f"{key}: {msg}{shown}")
    return f"invalid config {origin}: " + "; ".join(problems)


