"""How a model is named: a package's address and the two hashes that pin it (`ModelRef`), and
the champion pointer that names the promoted one (`ChampionPointer`). Torch-free: the launcher,
the CLI and the unchanged-rerun shortcut read them."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from training.errors import StorageError
from training.storage.files import read_json

__all__ = ["ChampionPointer", "ModelRef", "read_pointer"]

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class ModelRef(BaseModel):
    """An exported model package and the two hashes that pin it."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    uri: str
    sha256: str
    meta_sha256: str


class ChampionPointer(BaseModel):
    """models/champion: which package is the champion, the hashes that pin it, and what it
    scored when it was promoted."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    sha256: str
    meta_sha256: str | None = None
    uri: str | None = None
    run_key: str | None = None
    dataset: str | None = None
    metrics: dict[str, float] | None = None  # its test metrics when promoted
    export: str | None = None  # where its portable export is, or why it has none


def read_pointer(path: Path) -> ChampionPointer | None:
    """The pointer at `path` (None: no champion), or a StorageError saying why it is unusable.
    Its sha256 names a folder under models/: anything but 64 hex digits is refused."""
    raw = read_json(path)
    if raw is None:
        return None
    try:
        pointer = ChampionPointer.model_validate(raw)
    except ValidationError:
        raise StorageError(f"{path} is not a champion pointer") from None
    if not _SHA256.match(pointer.sha256):
        raise StorageError(f"{path} names no valid sha256")
    return pointer
