"""What a parent hands a child through a file: sealed by its sha256, which reaches the child on
its command line (or on the stdin of a warm child), never through the storage root.

The storage root is written by other teams and machines; a file the parent writes there and the
child reads a few seconds later (its start-up under load) can be replaced in between. A sealed
file cannot: the child reads the bytes once, checks them against the digest its parent gave it,
and only then parses them. So a training job, a stage's request, a calibration job and the
frozen job of every node of a multi-node run are what their parent decided, or the child stops
with one line before it reads anything else.

The argument form is `PATH#sha256=HEX`. Every child entry point takes its input this way; a
bare path is refused (nothing starts a child without a seal).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from training.errors import StorageError
from training.storage.files import read_pinned, write_atomic

__all__ = ["Sealed", "seal", "seal_private"]

_ARG = re.compile(r"^(?P<path>.+)#sha256=(?P<digest>[0-9a-f]{64})$")


@dataclass(frozen=True)
class Sealed:
    """A file and the sha256 its bytes must have."""

    path: Path
    sha256: str

    def arg(self) -> str:
        """The command-line form: `PATH#sha256=HEX`."""
        return f"{self.path}#sha256={self.sha256}"

    @classmethod
    def parse(cls, arg: str) -> Sealed:
        match = _ARG.match(arg)
        if match is None:
            raise StorageError(f"{arg!r} is not a sealed input (PATH#sha256=HEX): a child process is started by its "
                               "parent, which seals what it hands over; start the command that launches it instead")
        return cls(Path(match["path"]), match["digest"])

    def read(self, what: str) -> bytes:
        """The file's bytes, refused unless they are the ones the parent sealed. `what` names
        the input in the error ("the training job")."""
        return read_pinned(self.path, self.sha256, what, "wrote")


def seal(path: Path, data: bytes) -> Sealed:
    """Write `data` to `path` (atomically) and seal it."""
    write_atomic(path, data)
    return Sealed(path, hashlib.sha256(data).hexdigest())


def seal_private(folder: Path, name: str, data: bytes) -> Sealed:
    """`data` sealed in `folder`, a folder of this process only (mode 0700): another user of the
    machine cannot even read it, and no writer of the storage root can reach it."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    return seal(folder / name, data)
