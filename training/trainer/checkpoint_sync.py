"""Checkpoints to and from S3, behind the local ones.

Every checkpoint is first published locally (`training.trainer.checkpoint`), then handed to a
background thread that uploads its files, checks their sizes on S3, and uploads the manifest
last: a checkpoint on S3 without its manifest is incomplete and is never downloaded, so a
kill mid-upload cannot leave a "latest" that points at half a checkpoint. Only then does
remote retention run (last k complete, the best, the resumed-from), so deletes always follow a
newer verified checkpoint.

The loop never waits for the network: while an upload runs, newer checkpoints replace the
pending one (only the newest matters for a resume). A failed upload is logged and retried
with the next checkpoint; `flush()` at the end (and after an emergency save) waits for the
newest and raises if it could not be uploaded.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path

from training.errors import CheckpointError, RetrainError, StorageError
from training.protocol.runs import step_dir_name, step_of
from training.storage.root import CHECKPOINT, RUN, StorageRoot
from training.trainer.checkpoint import list_checkpoints, parse_manifest, verify_checkpoint

__all__ = ["CheckpointUploader", "remote_checkpoints", "restore_newer_checkpoint"]

log = logging.getLogger(__name__)
_MANIFEST = "manifest.json"


def remote_checkpoints(root: StorageRoot, ckpt_rel: str) -> dict[int, dict[str, int]]:
    """{step: {file name: size}} of the checkpoints under `ckpt_rel` on S3."""
    assert root.remote is not None
    out: dict[int, dict[str, int]] = {}
    for key, size in root.remote.list(ckpt_rel + "/").items():
        parts = key[len(ckpt_rel) + 1 :].split("/")
        step = step_of(parts[0]) if len(parts) == 2 else None
        if step is not None:
            out.setdefault(step, {})[parts[1]] = size
    return out


def restore_newer_checkpoint(root: StorageRoot, ckpt_rel: str, ckpt_dir: Path) -> int | None:
    """Download the newest complete checkpoint on S3 that is newer than every local one (a fresh
    machine has none); returns its step, or None when the local ones are as new."""
    local_steps = []
    for path in list_checkpoints(ckpt_dir):
        step = step_of(path.name)
        if step is not None and (path / _MANIFEST).exists():
            local_steps.append(step)
    newest_local = max(local_steps, default=-1)
    remote = remote_checkpoints(root, ckpt_rel)
    for step in sorted((s for s, files in remote.items() if _MANIFEST in files), reverse=True):
        if step <= newest_local:
            return None
        name = step_dir_name(step)
        tmp = ckpt_dir / f".{name}.download"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            manifest_bytes = root.remote.get_bytes(f"{ckpt_rel}/{name}/{_MANIFEST}") if root.remote else None
            if manifest_bytes is None:
                continue  # deleted meanwhile
            manifest = parse_manifest(manifest_bytes, root.display(f"{ckpt_rel}/{name}"))
            for file, meta in manifest.files.items():
                assert root.remote is not None
                root.remote.download_file(f"{ckpt_rel}/{name}/{file}", tmp / file, size=meta.bytes,
                                          sha256=meta.sha256)
            (tmp / _MANIFEST).write_bytes(manifest_bytes)  # last, as on S3
            verify_checkpoint(tmp)
        except (CheckpointError, StorageError, ValueError, TypeError) as err:
            log.warning("skipping checkpoint %s on S3: %s", name, err)
            shutil.rmtree(tmp, ignore_errors=True)
            continue
        final = ckpt_dir / name
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        log.info("downloaded checkpoint %s from %s", name, root.display(ckpt_rel))
        return step
    return None


class CheckpointUploader:
    """Uploads published checkpoints of one run in a background thread (see the module docstring)."""

    def __init__(self, root: StorageRoot, run_rel: str, run_key: str, keep_last: int) -> None:
        assert root.remote is not None
        self.root = root
        self.run_rel = run_rel
        self.ckpt_rel = f"{run_rel}/checkpoints"
        self.run_key = run_key
        self.keep_last = keep_last
        self._cv = threading.Condition()
        self._pending: tuple[Path, set[int]] | None = None
        self._busy = False
        self._uploading: int | None = None
        self._closed = False
        self._last_error: BaseException | None = None
        self.uploaded: list[int] = []
        self.superseded = 0
        self.failures = 0
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="checkpoint-upload", daemon=True)
        self._thread.start()

    def in_flight(self) -> set[int]:
        """The steps being uploaded or queued: local retention must keep them until their upload
        ends, or on a slow link it could delete every checkpoint before one reached S3."""
        with self._cv:
            steps = {self._uploading, step_of(self._pending[0].name) if self._pending is not None else None}
            return {s for s in steps if s is not None}

    def submit(self, path: Path, protect: set[int]) -> None:
        with self._cv:
            if self._pending is not None:
                self.superseded += 1  # a newer checkpoint makes the queued one pointless
            self._pending = (path, set(protect))
            self._cv.notify_all()

    def flush(self) -> None:
        """Wait until the newest submitted checkpoint is on S3; raise if its upload failed."""
        with self._cv:
            while self._pending is not None or self._busy:
                self._cv.wait()
            err, self._last_error = self._last_error, None
        if err is not None:
            if isinstance(err, RetrainError):
                raise err
            raise StorageError(f"checkpoint upload to {self.root.display(self.ckpt_rel)} failed: {err}") from None

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._pending is None and not self._closed:
                    self._cv.wait()
                if self._pending is None:
                    return
                path, protect = self._pending
                self._pending = None
                self._busy = True
                self._uploading = step_of(path.name)
            t0 = time.perf_counter()
            try:
                self._upload(path, protect)
                error = None
            except FileNotFoundError:
                error = None  # removed by local retention: a newer checkpoint is queued or uploaded
            except BaseException as err:  # noqa: BLE001 - reported by flush(), logged now
                error = err
                self.failures += 1
                log.warning("checkpoint upload of %s failed; the next checkpoint tries again: %s", path.name, err)
            with self._cv:
                self.seconds += time.perf_counter() - t0
                self._last_error = error
                self._busy = False
                self._uploading = None
                self._cv.notify_all()

    def _upload(self, path: Path, protect: set[int]) -> None:
        remote = self.root.remote
        assert remote is not None
        step = step_of(path.name)
        if step is None:
            raise CheckpointError(f"{path} is not a checkpoint folder (step-NNNNNNNN)")
        rel = f"{self.ckpt_rel}/{path.name}"
        manifest = parse_manifest((path / _MANIFEST).read_bytes(), str(path))
        tags = self.root.tags(CHECKPOINT, self.run_key)
        for name in manifest.files:
            remote.upload_file(f"{rel}/{name}", path / name, tags)
        # Verified before it is declared complete: every file there, at its size. The same
        # listing of the run's checkpoints then serves retention (one LIST per checkpoint).
        checkpoints = remote_checkpoints(self.root, self.ckpt_rel)
        for name, meta in manifest.files.items():
            if checkpoints.get(step, {}).get(name) != meta.bytes:
                raise StorageError(f"{remote.uri(rel)}/{name} is not on S3 at {meta.bytes} bytes after its upload")
        remote.upload_file(f"{rel}/{_MANIFEST}", path / _MANIFEST, tags)  # last: now it is complete
        checkpoints[step][_MANIFEST] = (path / _MANIFEST).stat().st_size
        ledger = self.root.path(f"{self.run_rel}/attempts.jsonl")
        if ledger.exists():
            remote.upload_file(f"{self.run_rel}/attempts.jsonl", ledger, self.root.tags(RUN, self.run_key))
        self.uploaded.append(step)
        self._retain(step, protect, checkpoints)

    def _retain(self, newest: int, protect: set[int], checkpoints: dict[int, dict[str, int]]) -> None:
        remote = self.root.remote
        assert remote is not None
        complete = sorted((s for s, files in checkpoints.items() if _MANIFEST in files), reverse=True)
        keep = set(complete[: self.keep_last]) | (protect & set(complete)) | {newest}
        doomed = [(step, name) for step, files in checkpoints.items() if step not in keep for name in files]
        # Manifests first, in their own request: a checkpoint is never complete with files missing.
        manifests = [f"{self.ckpt_rel}/{step_dir_name(s)}/{n}" for s, n in doomed if n == _MANIFEST]
        others = [f"{self.ckpt_rel}/{step_dir_name(s)}/{n}" for s, n in doomed if n != _MANIFEST]
        if manifests:
            remote.delete(manifests)
        if others:
            remote.delete(others)
