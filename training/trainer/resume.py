"""Resuming a run inside the training process: where an attempt starts and what the attempts
before it lost. One of the three files of resume (with `checkpoint`, which writes and verifies
checkpoints, and `checkpoint_sync`, which keeps them on S3); the run folder as the launcher sees
it (finished or not, the attempts ledger) is `training.protocol.runs`.

- On an s3:// root, a fresh machine first restores the attempts ledger and the newest complete
  checkpoint from S3; rank 0 then uploads every new checkpoint (`ResumeBook`).
- The newest verified local checkpoint is the resume point, and only if it belongs to this
  run key and train fingerprint (anything else is refused, never silently trained over).
- The heartbeat says how far a dead attempt got past that checkpoint (the "lost work"): a local
  file overwritten in place every step (exact on the same machine), and on an s3:// root a small
  object published every `storage.heartbeat_seconds`, so a resume on a fresh machine still
  counts what was lost, to within one interval.
- The attempts ledger (`training.protocol.runs`): each process appends its resume point, the work
  lost and its start-up time before it trains.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter
from pydantic.dataclasses import dataclass as pydantic_dataclass

from training.errors import CheckpointError, RetrainError, StorageError
from training.protocol.job import TrainJob
from training.protocol.runs import AttemptRecord, append_attempt, read_attempts
from training.storage.root import RUN, StorageRoot

if TYPE_CHECKING:
    from training.trainer.checkpoint_sync import CheckpointUploader
    from training.trainer.state import Progress

__all__ = ["Beat", "Heartbeat", "RemoteHeartbeat", "ResumeBook"]

log = logging.getLogger(__name__)


class ResumeBook:
    """The resume side of one attempt: restore, resume point, lost work, the ledger, uploads."""

    def __init__(self, job: TrainJob, rank: int = 0, world_size: int = 1, spawn_time: float | None = None) -> None:
        self.job, self.rank, self.world_size = job, rank, world_size
        self.spawn_time = time.time() if spawn_time is None else spawn_time
        self.run_dir = Path(job.run_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        storage = job.config.storage
        self.root = StorageRoot.from_config(job.config) if storage.is_s3 and job.run_rel else None
        remote_beat = None
        if self.root is not None and rank == 0:
            remote_beat = RemoteHeartbeat(self.root, job.run_rel, job.run_key, storage.heartbeat_seconds)
        name = "heartbeat.bin" if rank == 0 else f"heartbeat-rank{rank}.bin"
        self.heartbeat = Heartbeat(self.run_dir / name, remote_beat)
        self.uploader: CheckpointUploader | None = None
        self.resumed_step: int | None = None  # None: this attempt starts the run afresh
        self.resumed_from: Path | None = None

    def restore_remote(self) -> None:
        """A fresh machine: the ledger and the newest complete checkpoint come from S3, fetched
        by one process per node (they share its disk) while the node's other ranks wait."""
        if self.root is None:
            return
        from training.trainer.checkpoint_sync import CheckpointUploader, restore_newer_checkpoint

        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            self.root.fetch(f"{self.job.run_rel}/attempts.jsonl")
            restore_newer_checkpoint(self.root, f"{self.job.run_rel}/checkpoints", self.ckpt_dir)
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()
        if self.rank == 0:
            self.uploader = CheckpointUploader(self.root, self.job.run_rel, self.job.run_key,
                                               self.job.config.train.checkpoint.keep_last)

    def latest_checkpoint(self, config_fingerprint: str) -> dict[str, Any] | None:
        """The newest verified checkpoint's state, when it belongs to this run."""
        from training.trainer.checkpoint import latest_verified_state

        found = latest_verified_state(self.ckpt_dir)
        if found is None:
            if self.ckpt_dir.exists() and any(self.ckpt_dir.iterdir()):
                log.warning("no verified checkpoint in %s: starting from step 0", self.ckpt_dir)
            return None
        path, manifest, saved = found
        if manifest.run_key != self.job.run_key or manifest.config_fingerprint != config_fingerprint:
            raise CheckpointError(
                f"checkpoint {path} belongs to run {manifest.run_key} (config {manifest.config_fingerprint}), "
                f"not {self.job.run_key} (config {config_fingerprint}); move it away or use a fresh storage.root"
            )
        self.resumed_from = path
        return saved

    def account(self, progress: Progress) -> None:
        """Record this attempt in the ledger (with the work the last one lost) and put the
        run's totals into `progress`, which holds the resumed checkpoint's state if any."""
        steps_lost, seconds_lost = 0, 0.0
        beat = self.heartbeat.read()
        if self.resumed_from is not None:
            self.resumed_step = progress.step
            if beat is not None and beat.step > progress.step:
                steps_lost = beat.step - progress.step
                seconds_lost = max(0.0, beat.train_seconds - progress.seconds.train)
        elif beat is not None and beat.step > 0:
            # An earlier attempt died before its first checkpoint: all of it was lost.
            self.resumed_step, steps_lost, seconds_lost = 0, beat.step, beat.train_seconds
        self.heartbeat.start(progress.step, progress.seconds.train)
        entry = AttemptRecord(resumed_from=self.resumed_step, steps_lost=steps_lost, seconds_lost=seconds_lost,
                              startup_seconds=time.time() - self.spawn_time)
        records = append_attempt(self.run_dir / "attempts.jsonl", entry) if self.rank == 0 else [entry]
        # A tuning trial's pauses at its rungs are planned stops, a user's interrupts are their
        # own, and a budget's stop is continued by a larger budget: none is a preemption, nor a
        # cost of running on spot.
        pauses = sum(1 for e in records if e.planned_stop)
        entries = [e for e in records if not e.planned_stop]
        progress.resumed_from_steps = [e.resumed_from for e in entries if e.resumed_from is not None]
        progress.steps_lost = sum(e.steps_lost for e in entries)
        progress.seconds.lost = sum(e.seconds_lost for e in entries)
        progress.seconds.startup = sum(e.startup_seconds for e in entries)
        # An attempt killed before it got this far leaves only the launcher's count.
        progress.preemptions = max(len(entries) - 1, read_attempts(self.run_dir) - 1) - pauses

    def make_resume_point_durable(self) -> None:
        """Resumed from a local checkpoint S3 may lack (its upload was cut off): upload it."""
        if self.uploader is None or self.root is None or self.resumed_from is None:
            return
        step = self.resumed_step or 0
        from training.trainer.checkpoint_sync import remote_checkpoints

        remote_steps = remote_checkpoints(self.root, f"{self.job.run_rel}/checkpoints")
        if "manifest.json" not in remote_steps.get(step, {}):
            self.uploader.submit(self.resumed_from, {step})


@pydantic_dataclass(frozen=True)
class Beat:
    """heartbeat.json (and heartbeat.bin): how far the attempt that published it got."""

    step: int
    train_seconds: float


class RemoteHeartbeat:
    """The run's heartbeat on S3, published from a background thread (the loop never waits)."""

    def __init__(self, root: StorageRoot, run_rel: str, run_key: str, interval_s: float) -> None:
        assert root.remote is not None
        self.root, self.rel, self.run_key, self.interval_s = root, f"{run_rel}/heartbeat.json", run_key, interval_s
        self._latest: tuple[int, float] | None = None  # (step, train seconds), set every step
        self._published: tuple[int, float] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> Beat | None:
        """The last beat a dead attempt published, or None (none yet, or unreadable: accounting
        only, so a damaged object is a warning, never a failed run)."""
        assert self.root.remote is not None
        try:
            raw = self.root.remote.get_bytes(self.rel)
            if raw is None:
                return None
            return TypeAdapter(Beat).validate_json(raw)
        except (RetrainError, ValueError) as err:  # ValueError: pydantic's ValidationError too
            log.warning("ignoring the run's heartbeat %s: %s", self.root.display(self.rel), err)
            return None

    def start(self, beat: Beat) -> None:
        """Publish `beat` now (the resumed step: work lost before it is already counted, so a
        later resume must not count it again), then every interval from a thread."""
        self._latest = (beat.step, beat.train_seconds)
        self._publish()
        self._thread = threading.Thread(target=self._run, name="heartbeat-upload", daemon=True)
        self._thread.start()

    def update(self, step: int, train_seconds: float) -> None:
        self._latest = (step, train_seconds)  # one tuple per step, no object built; the thread reads it

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._publish()
            except RetrainError as err:  # the next interval tries again; only accounting suffers
                log.warning("could not publish the run's heartbeat: %s", err)

    def _publish(self) -> None:
        beat = self._latest
        if beat is None or beat == self._published:
            return
        assert self.root.remote is not None
        body = json.dumps({"step": beat[0], "train_seconds": beat[1]}).encode()
        self.root.remote.put_bytes(self.rel, body, self.root.tags(RUN, self.run_key))
        self._published = beat


class Heartbeat:
    """The local heartbeat file, and the remote one behind it when the root is on S3.

    The local file is also the run's writer lock: held while training (the kernel frees it when
    the process dies), so the heartbeat read at start-up is always a dead attempt's."""

    _FMT = "<qd"

    def __init__(self, path: Path, remote: RemoteHeartbeat | None = None) -> None:
        import fcntl

        self.path, self.remote = path, remote
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            # A POSIX record lock, not flock: it conflicts only with other processes, so a second
            # train() in this process (after an error left the first's descriptor open) is fine.
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # EACCES or EAGAIN: another process holds it
            os.close(self._fd)
            raise StorageError(f"run folder {path.parent} is being trained by another live process right now; "
                               "two processes must not train one run: wait for it to finish") from None

    def read(self) -> Beat | None:
        """The furthest beat of a dead attempt: the local file's on the same machine, the S3
        object's on a fresh one."""
        size = struct.calcsize(self._FMT)
        data = os.pread(self._fd, size, 0)
        local = Beat(*struct.unpack(self._FMT, data)) if len(data) == size else None
        remote = self.remote.read() if self.remote is not None else None
        beats = [b for b in (local, remote) if b is not None]
        return max(beats, key=lambda b: b.step) if beats else None

    def start(self, step: int, train_seconds: float) -> None:
        """Record where this attempt starts, before its first step: a kill before step 1 is then
        counted once, and the work lost before this point is never counted twice."""
        self.write(step, train_seconds)
        if self.remote is not None:
            self.remote.start(Beat(step, train_seconds))

    def write(self, step: int, train_seconds: float) -> None:
        os.pwrite(self._fd, struct.pack(self._FMT, step, train_seconds), 0)
        if self.remote is not None:
            self.remote.update(step, train_seconds)

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()
        os.close(self._fd)
