"""Atomic, verified checkpoints: save, find the newest good one, load, retain.

A checkpoint is the folder `step-{n:08d}/` holding `state.pt` and `manifest.json`. It is written
under a temporary name, its manifest (sha256 and size of every file) is written last, and the
folder is renamed into place. A folder without a verifying manifest is never resumed from:
a torn write, flipped bytes or a missing file make the loader warn, name it, and fall back to
the previous good checkpoint.

States load with `torch.load(weights_only=True)`, which cannot execute code.
"""

from __future__ import annotations

import hashlib
import builtins
import io
import json
import logging
import math
import os
import shutil
import threading
import time
from dataclasses import asdict, field
from pathlib import Path
from typing import IO, Any, Callable, cast

import torch
import xxhash
from pydantic import ValidationError, model_validator
from pydantic.dataclasses import dataclass

from training.errors import CheckpointError, StorageError
from training.protocol.results import CheckpointInterval
from training.protocol.runs import step_dir_name, step_of
from training.storage.files import HashingWriter, fsync_dir, is_plain_name, process_alive
from training.trainer.state import Progress

__all__ = ["AsyncCheckpointer", "CheckpointManifest", "CheckpointSchedule", "apply_retention", "latest_verified_checkpoint", "latest_verified_state", "list_checkpoints", "load_checkpoint_state", "parse_manifest", "save_checkpoint", "snapshot", "verify_checkpoint"]

log = logging.getLogger(__name__)
CHECKPOINT_FORMAT = 1
_STATE = "state.pt"
_MANIFEST = "manifest.json"


@dataclass
class FileEntry:
    """One file of a checkpoint as its manifest lists it: its size and hash, xxh3_128 (written
    now) or sha256 (checkpoints written before). The hash finds a torn or corrupted write; it
    is no proof of origin, whatever its strength, since the manifest beside it is as writable
    as the state, and a state loads with weights_only either way. xxh3 does that work at a
    tenth of sha256's CPU on the writer's thread, which on a busy machine is the step's."""

    bytes: int
    sha256: str | None = None
    xxh3_128: str | None = None

    @model_validator(mode="after")
    def _hashed(self) -> FileEntry:
        if self.sha256 is None and self.xxh3_128 is None:
            raise ValueError("a checkpoint file needs its xxh3_128 or sha256")
        return self

    def matches(self, data: builtins.bytes) -> bool:  # builtins: `bytes` is a field here
        if self.xxh3_128 is not None:
            return xxhash.xxh3_128(data).hexdigest() == self.xxh3_128
        return hashlib.sha256(data).hexdigest() == self.sha256


@dataclass
class CheckpointManifest:
    """manifest.json, validated as it is read (a pydantic dataclass): it comes from storage."""

    step: int
    run_key: str
    config_fingerprint: str
    files: dict[str, FileEntry]
    val_auc: float | None = None
    emergency: bool = False
    format: int = CHECKPOINT_FORMAT
    extra: dict[str, Any] = field(default_factory=dict)


def save_checkpoint(ckpt_root: Path, manifest: CheckpointManifest, state: dict[str, Any]) -> Path:
    """Write `state` durably and publish it; returns the checkpoint folder.

    A failed write (full disk, read-only storage) removes its temp folder and raises one
    StorageError naming the checkpoint; published checkpoints are never touched."""
    final = ckpt_root / step_dir_name(manifest.step)
    tmp = ckpt_root / f".{final.name}.tmp-{os.getpid()}"
    try:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        _write_state(tmp, manifest, state)
    except (OSError, RuntimeError) as err:
        shutil.rmtree(tmp, ignore_errors=True)
        cause = _os_error_in(err)
        if cause is None:
            raise  # not the storage: a bug, with its traceback
        raise StorageError(f"checkpoint write failed at {final}: {cause.strerror or cause}; free space (or make "
                           "it writable) and run the same command again to resume") from None
    if final.exists():
        # Same step saved again (e.g. an emergency save right after a periodic one): swap it.
        trash = ckpt_root / f".{final.name}.old-{os.getpid()}"
        os.rename(final, trash)
        os.rename(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_dir(ckpt_root)
    return final


def _write_state(tmp: Path, manifest: CheckpointManifest, state: dict[str, Any]) -> None:
    state_path = tmp / _STATE
    with open(state_path, "wb") as f:
        # Hashed as it is written: no second pass over the file. xxh3_128, not sha256: it finds
        # what a checkpoint's hash is for (a torn or corrupted write) at a fraction of the CPU, so
        # the write costs what a durable torch.save costs (see FileEntry). Through a Python file,
        # not a path: a full disk then surfaces as OSError (ENOSPC), where torch's own writer
        # raises a RuntimeError that names no cause.
        hashing = HashingWriter(f, xxhash.xxh3_128())
        torch.save(state, cast(IO[bytes], hashing))
        f.flush()
        os.fsync(f.fileno())
    digest = hashing.hexdigest()
    manifest.files = {_STATE: FileEntry(xxh3_128=digest, bytes=state_path.stat().st_size)}
    with open(tmp / _MANIFEST, "w") as f:
        json.dump(asdict(manifest), f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)


def _os_error_in(err: BaseException) -> OSError | None:
    """The OSError behind `err`: torch.save reports a failed write as a RuntimeError whose
    context is the file's OSError (ENOSPC, EROFS, EIO)."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Published checkpoint folders, newest first (verified or not)."""
    if not ckpt_root.exists():
        return []
    return sorted((p for p in ckpt_root.iterdir() if p.is_dir() and p.name.startswith("step-")), reverse=True)


def parse_manifest(raw: bytes | str, where: str) -> CheckpointManifest:
    """A checkpoint manifest read from disk or S3; every file it names must be a plain name,
    so that a tampered manifest cannot make a reader write or read outside the checkpoint."""
    try:
        manifest = CheckpointManifest(**json.loads(raw))
    except (json.JSONDecodeError, TypeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"checkpoint {where}: unreadable manifest ({err})") from None
    except ValidationError as err:
        raise CheckpointError(f"checkpoint {where}: unreadable manifest ({err.errors()[0]['msg']})") from None
    bad = [name for name in manifest.files if not is_plain_name(name)]
    if bad:
        raise CheckpointError(f"checkpoint {where}: manifest names files outside the checkpoint ({bad[0]!r}); "
                              f"refusing it")
    return manifest


def _read_manifest(path: Path) -> CheckpointManifest:
    try:
        raw = (path / _MANIFEST).read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: no manifest (torn write)") from None
    return parse_manifest(raw, str(path))


def _read_verified(path: Path, name: str, meta: FileEntry) -> bytes:
    """The bytes of one listed file, checked against its manifest entry."""
    try:
        data = (path / name).read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: file {name} is missing") from None
    if len(data) != meta.bytes:
        raise CheckpointError(f"checkpoint {path}: {name} is {len(data)} bytes, manifest says {meta.bytes}")
    if not meta.matches(data):
        kind = "xxh3_128" if meta.xxh3_128 is not None else "sha256"
        raise CheckpointError(f"checkpoint {path}: {name} does not match its {kind} (corrupted)")
    return data


def verify_checkpoint(path: Path) -> CheckpointManifest:
    """The manifest of `path` if every file it lists matches; else CheckpointError saying why."""
    manifest = _read_manifest(path)
    for name, meta in manifest.files.items():
        _read_verified(path, name, meta)
    return manifest


def _load_state(path: Path, data: bytes | Path) -> dict[str, Any]:
    try:
        return torch.load(io.BytesIO(data) if isinstance(data, bytes) else data, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unpickling failure means an unusable file
        raise CheckpointError(f"checkpoint {path}: cannot load {_STATE} ({err})") from None


def latest_verified_state(ckpt_root: Path) -> tuple[Path, CheckpointManifest, dict[str, Any]] | None:
    """The newest checkpoint that verifies, and its state, reading each file once (restart
    time); torn or corrupt checkpoints are skipped with a warning naming them."""
    for path in list_checkpoints(ckpt_root):
        try:
            manifest = _read_manifest(path)
            data = _read_verified(path, _STATE, manifest.files[_STATE])
            return path, manifest, _load_state(path, data)
        except (CheckpointError, KeyError) as err:
            log.warning("skipping checkpoint: %s", err)
    return None


def latest_verified_checkpoint(ckpt_root: Path) -> tuple[Path, CheckpointManifest] | None:
    """The newest checkpoint that verifies; torn or corrupt ones are skipped with a warning."""
    for path in list_checkpoints(ckpt_root):
        try:
            return path, verify_checkpoint(path)
        except CheckpointError as err:
            log.warning("skipping checkpoint: %s", err)
    return None


def load_checkpoint_state(path: Path) -> dict[str, Any]:
    return _load_state(path, path / _STATE)


def _looks_complete(path: Path) -> bool:
    """Cheap check (manifest present, sizes match); the full sha256 check happens on load."""
    try:
        manifest = CheckpointManifest(**json.loads((path / _MANIFEST).read_text()))
        return all((path / n).stat().st_size == m.bytes for n, m in manifest.files.items())
    except (OSError, ValueError, TypeError):  # ValueError: pydantic's ValidationError too
        return False


def apply_retention(ckpt_root: Path, keep_last: int, protect: set[int]) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints and the `protect`ed steps.

    Called only after a newer checkpoint has been published, so the checkpoint a run resumed
    from survives until a newer verified one exists. Torn folders and stale temp folders of
    dead writers are removed too.
    """
    deleted = []
    kept = 0
    for path in list_checkpoints(ckpt_root):
        step = step_of(path.name)
        complete = _looks_complete(path)
        if complete and kept < keep_last:
            kept += 1
            continue
        if complete and step in protect:
            continue
        shutil.rmtree(path, ignore_errors=True)
        deleted.append(path)
    for tmp in ckpt_root.glob(".step-*"):
        if not _writer_alive(tmp.name):
            shutil.rmtree(tmp, ignore_errors=True)
    return deleted


def _writer_alive(tmp_name: str) -> bool:
    """Whether the process named by a temp folder (`.step-N.tmp-<pid>`, `.old-<pid>`) is alive:
    another process's save in flight is never deleted, only a dead writer's leftovers."""
    pid = tmp_name.rsplit("-", 1)[-1]
    return pid.isdigit() and process_alive(int(pid))


def snapshot(obj: Any, into: Any = None) -> Any:
    """A deep copy of every tensor in a nested state, on the CPU, so training can go on
    mutating the originals while the copy is written. Tensors are copied into `into` (an
    earlier snapshot of the same structure) wherever shape and dtype match: writing into pages
    already mapped is about 4x faster than allocating ~100 MB afresh (6 ms against 24 ms,
    measured), and that copy is the training loop's whole stall."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if (isinstance(into, torch.Tensor) and into.shape == t.shape and into.dtype == t.dtype
                and into.device.type == "cpu" and into.is_contiguous()):
            return into.copy_(t)
        return t.to("cpu", copy=True)
    if isinstance(obj, dict):
        prev = into if isinstance(into, dict) else {}
        return {k: snapshot(v, prev.get(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        prev_seq = into if isinstance(into, type(obj)) and len(into) == len(obj) else [None] * len(obj)
        return type(obj)(snapshot(v, p) for v, p in zip(obj, prev_seq, strict=True))
    return obj


class AsyncCheckpointer:
    """Writes checkpoints in a background thread; the loop only waits for the in-memory copy.

    At most one save is in flight: a new save first waits for the previous one, so memory
    stays bounded at one extra copy of the state, which is kept between saves and overwritten
    by the next (see `snapshot`): the peak is what it was, the copy is simply not freed.
    Retention runs after each publish, in the same thread, so deletes always follow a newer
    verified checkpoint.
    """

    def __init__(
        self, ckpt_root: Path, keep_last: int, on_published: Callable[[Path, set[int]], None] | None = None,
        in_use: Callable[[], set[int]] = set,
    ) -> None:
        self.ckpt_root = ckpt_root
        self.keep_last = keep_last
        self.on_published = on_published  # e.g. hand the new checkpoint to the S3 uploader
        self.in_use = in_use  # steps retention must keep for now (the one being uploaded)
        self._thread: threading.Thread | None = None
        self._copy: Any = None  # the last snapshot, reused by the next
        self._error: BaseException | None = None
        self.background_seconds = 0.0
        self.background_cpu_seconds = 0.0  # the writer thread's own CPU (the kernel's writeback is not in it)
        self.retry_pause_s = 1.0

    @property
    def failed(self) -> bool:
        """A background save failed (checked every step: training must not go on past it)."""
        return self._error is not None

    @property
    def writing(self) -> bool:
        """A background write is still under way."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def save(self, manifest: CheckpointManifest, state: dict[str, Any], protect: set[int], blocking: bool = False) -> None:
        self.wait()  # the previous write is done with the copy: it can be overwritten
        copy = self._copy = snapshot(state, self._copy)

        def write() -> None:
            t0, cpu0 = time.perf_counter(), time.thread_time()
            try:
                try:
                    published = save_checkpoint(self.ckpt_root, manifest, copy)
                except StorageError as err:
                    # Once more after a pause: space freed by another process, a passing I/O error.
                    log.warning("%s; trying once more", err)
                    time.sleep(self.retry_pause_s)
                    published = save_checkpoint(self.ckpt_root, manifest, copy)
                apply_retention(self.ckpt_root, self.keep_last, protect | self.in_use())
                if self.on_published is not None:
                    self.on_published(published, protect)
            except BaseException as err:  # noqa: BLE001 - handed to the loop by wait()
                self._error = err
            finally:
                self.background_seconds += time.perf_counter() - t0
                self.background_cpu_seconds += time.thread_time() - cpu0

        if blocking:
            write()
            self.wait()
            return
        self._thread = threading.Thread(target=write, name=f"checkpoint-{manifest.step}", daemon=True)
        self._thread.start()


class CheckpointSchedule:
    """Every N steps, every S seconds of training, or (`auto`) the Young/Daly optimum
    sqrt(2 * save cost * mean time between preemptions) from the measured save cost."""

    def __init__(self, mode: str, value: float, mean_seconds_between_preemptions: float) -> None:
        self.mode, self.value, self.mtbp = mode, value, mean_seconds_between_preemptions

    def interval_seconds(self, progress: Progress) -> float | None:
        if self.mode == "seconds":
            return self.value
        if self.mode == "auto" and progress.save_cost_seconds is not None:
            return math.sqrt(2.0 * progress.save_cost_seconds * self.mtbp)
        return None

    def due(self, progress: Progress) -> bool:
        if self.mode == "steps":
            return progress.step % int(self.value) == 0
        interval = self.interval_seconds(progress)
        return interval is not None and progress.seconds.train - progress.last_save_train_seconds >= interval

    def describe(self, progress: Progress) -> CheckpointInterval:
        return CheckpointInterval(mode=self.mode, steps=int(self.value) if self.mode == "steps" else None,
                                  seconds=self.interval_seconds(progress), save_cost_seconds=progress.save_cost_seconds,
                                  mean_seconds_between_preemptions=self.mtbp if self.mode == "auto" else None)
