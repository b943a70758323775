"""The champion as read back from the storage root: fetched, verified, and either usable or
unusable with a reason.

A damaged or untrusted champion must never block retraining for ever (every later run would
fail the same way): it is reported, and the challenger is judged against `eval.target_auc`
alone. Verification happens before training starts, so a run learns of it in seconds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.errors import CheckpointError, StorageError
from training.model.evaluation import champion_package, read_champion
from training.model.package import UntrustedFactory, load_package
from training.storage.root import StorageRoot

__all__ = ["Champion", "check_champion"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Champion:
    pointer: dict[str, Any]
    package: Path
    problem: str | None = None  # None: every file verified and the model loads
    recorded_metrics_only: bool = False  # unusable here, but its recorded test metrics still stand
    etag: str | None = None  # the pointer's S3 version: promotion swaps it only from this one

    @property
    def sha256(self) -> str:
        return str(self.pointer.get("sha256", ""))

    @property
    def usable(self) -> bool:
        return self.problem is None


def check_champion(root: StorageRoot, trusted_factory: str | None) -> Champion | None:
    """The current champion (None when there is none), verified file by file: the pointer's
    model.json hash, the weights' hash, and a factory this run's config names."""
    # Fresh, with its version: another run, on another machine, may have promoted since this
    # copy was made. An unreachable store raises here: only what was read and found wrong makes
    # a champion unusable.
    found, etag = root.fetch_versioned("models/champion")
    if found is None:
        return None
    try:
        pointer = read_champion(root.path("models"))
    except StorageError as err:  # not JSON
        return _unusable({}, root.path("models"), f"its pointer is unreadable: {err}", etag=etag)
    if pointer is None:
        return None
    if not isinstance(pointer, dict) or not isinstance(pointer.get("sha256"), str) or not _hex64(pointer["sha256"]):
        return _unusable({}, root.path("models"), "its pointer models/champion names no valid sha256", etag=etag)
    package = champion_package(root.path("models"), pointer)
    for name in ("model.json", "model.pt"):
        rel = f"models/{pointer['sha256']}/{name}"
        if root.fetch(rel) is None:
            return _unusable(pointer, package, f"{root.display(rel)} is missing", etag=etag)
    try:
        load_package(package, trusted_factory, pointer.get("meta_sha256"))
    except UntrustedFactory as err:
        return _unusable(pointer, package, str(err), recorded=isinstance(pointer.get("metrics"), dict), etag=etag)
    except (CheckpointError, StorageError, TypeError, KeyError, ValueError) as err:  # damaged content
        return _unusable(pointer, package, str(err), etag=etag)
    return Champion(pointer, package, etag=etag)


def _hex64(value: str) -> bool:
    return len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _unusable(pointer: dict[str, Any], package: Path, problem: str, recorded: bool = False,
              etag: str | None = None) -> Champion:
    log.warning("the champion %s is unusable: %s; this run's model will be judged %s",
                str(pointer.get("sha256", "?"))[:12], problem,
                "on the champion's recorded test metrics" if recorded else "against eval.target_auc alone")
    return Champion(pointer, package, problem, recorded, etag)
