"""Copies of typed values with some fields changed, validated as any new value is.

pydantic's `model_copy(update=...)` sets what it is given: a field of the wrong type, a value
its validators refuse, even a field the model does not have (`{"typo": 3}`) are all taken
silently, so a rewritten budget or step count could skip the very checks the config made when
it was loaded. `updated` builds the copy through validation instead.
"""

from __future__ import annotations

from typing import Any, Mapping, TypeVar

from pydantic import BaseModel

__all__ = ["updated"]

M = TypeVar("M", bound=BaseModel)


def updated(model: M, changes: Mapping[str, Any]) -> M:
    """`model` with `changes`, validated: a field the model lacks is a TypeError (a bug: the
    models here ignore unknown keys when they read files, so validation alone would drop it), a
    value it refuses a pydantic ValidationError. The fields given when `model` was made stay
    the given ones (`model_fields_set`), plus those changed: a default is still a default."""
    unknown = sorted(set(changes) - set(type(model).model_fields))
    if unknown:
        raise TypeError(f"{type(model).__name__} has no field {', '.join(map(repr, unknown))}")
    values = {name: getattr(model, name) for name in type(model).model_fields}
    copy = type(model).model_validate({**values, **changes})
    # Validation marks every field given; model_copy keeps the original's set, and so does this.
    object.__setattr__(copy, "__pydantic_fields_set__", set(model.model_fields_set) | set(changes))
    return copy
