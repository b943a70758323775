"""Durable local writes: temp file, fsync, atomic rename, fsync of the folder.

A reader sees either the old file or the new one, never a torn one, even across a power cut.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Protocol

from training.errors import StorageError

__all__ = ["write_atomic", "write_json_atomic", "fsync_dir", "read_json", "HashingWriter", "sha256_file",
           "is_plain_name", "inside", "process_alive", "read_pinned"]


def is_plain_name(name: object) -> bool:
    """Whether a file name read from storage (a manifest) is one plain path component: joining
    it to a folder must never leave that folder (`../x`, `/etc/x`, `a/b`, NUL)."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name)


def inside(base: Path, rel: str, what: str = "storage root") -> Path:
    """`base / rel`, refused unless it stays inside `base`: every component of `rel` must be a
    plain name (names come from manifests and records that whoever can write the root also
    writes), and no symbolic link on the way may lead out of `base` (a linked `runs/<key>` or
    `checkpoints/` would otherwise receive the run's files wherever it points)."""
    parts = rel.split("/")
    if not all(is_plain_name(part) for part in parts):
        raise StorageError(f"{rel!r} is not a path inside the {what} {base}; a manifest or record naming it is "
                           "damaged or tampered with")
    path = base.joinpath(*parts)
    resolved = path.resolve()  # follows the links of the components that exist
    real_base = base.resolve()
    if resolved != real_base and real_base not in resolved.parents:
        raise StorageError(f"{path} leads to {resolved}, outside the {what} {real_base} (a symbolic link); "
                           "remove the link: files under the root are never written through one")
    return path


def read_pinned(path: Path, sha256: str | None, what: str, verb: str = "read") -> bytes:
    """The bytes of `path`, refused unless their sha256 is `sha256` (unchecked when None: a job
    built by hand, in a test or a benchmark). For a file of the storage root that a parent read
    and pinned by its digest before it handed the job over (a dataset's manifest, the feature
    statistics)."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise StorageError(f"{what} {path} cannot be read ({err.strerror or err}): it was removed after the parent "
                           f"{verb} it; run the same command again") from None
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise StorageError(f"{what} {path} changed after the parent {verb} it (its sha256 is not the one the parent "
                           "handed over): another writer of this storage root replaced it. Nothing was read from "
                           "it; run the same command again, and keep the root writable only by the pipeline's own "
                           "runs")
    return data


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        # hashlib.file_digest does this from Python 3.11; the project supports 3.10.
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class Hasher(Protocol):
    def update(self, data: bytes, /) -> None: ...

    def hexdigest(self) -> str: ...


class HashingWriter:
    """Write-through file wrapper that hashes the bytes as they go: a file's digest without a
    second pass over it (shards: sha256; checkpoints: the `hasher` they name)."""

    def __init__(self, f: Any, hasher: Hasher | None = None) -> None:
        self._f = f
        self._h: Hasher = hasher if hasher is not None else hashlib.sha256()

    def write(self, data: bytes) -> int:
        self._h.update(data)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()

    def tell(self) -> int:
        return self._f.tell()

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as err:
        raise StorageError(f"cannot write {path}: {err.strerror or err}") from None


def write_json_atomic(path: Path, value: Any) -> None:
    write_atomic(path, (json.dumps(value, indent=1, sort_keys=True) + "\n").encode())


def read_json(path: Path) -> Any:
    """The JSON value in `path`; None when there is no such file. A file that is not UTF-8 JSON,
    or a folder in its place, is one StorageError naming it."""
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as err:
        raise StorageError(f"{path} is not valid JSON ({err.msg} at line {err.lineno})") from None
    except UnicodeDecodeError as err:
        raise StorageError(f"{path} is not valid JSON (a byte that is not UTF-8 at offset {err.start})") from None
    except IsADirectoryError:
        raise StorageError(f"{path} is a folder where a JSON file belongs") from None
    except OSError as err:
        raise StorageError(f"cannot read {path}: {err.strerror or err}") from None


def process_alive(pid: int) -> bool:
    """Whether a process of this machine with that pid exists (one we may not signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
