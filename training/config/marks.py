"""What each config field means to a run's content address: the marks every field carries
(COMPUTED, OPERATIONAL and their variants), and the fingerprints derived from them."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, JsonValue
from pydantic.json_schema import JsonDict

__all__ = ["COMPUTED", "COMPUTED_SINCE", "FLAT_COMPUTED", "OPERATIONAL", "computed_before", "fingerprint",
           "fingerprinted", "is_computed"]


# Every field of every section says whether it is part of what a run computes (COMPUTED: it
# feeds the content address of the dataset, the preprocessing or the run) or only of how it is
# executed, billed or stored (OPERATIONAL: a change never invalidates finished work). The
# fingerprints are derived from these marks (`fingerprinted`), and a test fails on a field
# without one, so a new field cannot silently join or leave a run key.
COMPUTED: JsonDict = {"fingerprint": True}
OPERATIONAL: JsonDict = {"fingerprint": False}
# A computed field added after datasets, caches and runs already exist: left out of the
# fingerprint while it holds its default, so existing content addresses (and the runs that
# resume under them) stay what they were; any other value is part of it.
COMPUTED_SINCE: JsonDict = {"fingerprint": True, "omit_default": True}
# A computed field whose default changed: left out of the fingerprint while it holds the value
# that reproduces the code before the change (set explicitly, an earlier run keeps its key); the
# new default is part of it, so a run on the new default is a new run.
def computed_before(legacy: JsonValue) -> JsonDict:
    return {"fingerprint": True, "omit_value": legacy}


# A computed section whose fields count as its parent's own: the parent's fingerprint is the
# one it had before the fields were grouped into the section.
FLAT_COMPUTED: JsonDict = {"fingerprint": True, "flatten": True}


def is_computed(section: type[BaseModel], name: str) -> bool:
    """The field's mark; a field without one is a bug (see COMPUTED above)."""
    extra = section.model_fields[name].json_schema_extra
    if not isinstance(extra, dict) or not isinstance(extra.get("fingerprint"), bool):
        raise TypeError(f"{section.__name__}.{name} is not marked COMPUTED or OPERATIONAL")
    return bool(extra["fingerprint"])


def fingerprinted(section: BaseModel) -> dict[str, Any]:
    """The section's COMPUTED fields as JSON, nested sections reduced the same way."""
    view: dict[str, Any] = {}
    for name, info in type(section).model_fields.items():
        if not is_computed(type(section), name):
            continue
        value = getattr(section, name)
        extra = info.json_schema_extra
        if isinstance(extra, dict) and extra.get("omit_default") and value == info.get_default(call_default_factory=True):
            continue
        if isinstance(extra, dict) and "omit_value" in extra and value == extra["omit_value"]:
            continue
        if isinstance(extra, dict) and extra.get("flatten") and isinstance(value, BaseModel):
            view.update(fingerprinted(value))
            continue
        view[name] = fingerprinted(value) if isinstance(value, BaseModel) else (
            section.model_dump(mode="json", include={name})[name])
    return view


def fingerprint(*parts: Any) -> str:
    """A short content address: sha256 of the canonical JSON of `parts`."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=_jsonable)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _jsonable(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    raise TypeError(f"cannot fingerprint {type(value).__name__}")


