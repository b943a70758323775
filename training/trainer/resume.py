"""Resume bookkeeping of one training attempt: where it starts and what the last one lost.

- On an s3:// root, a fresh machine first restores the attempts ledger and the newest complete
  checkpoint from S3; rank 0 then uploads every new checkpoint (`CheckpointUploader`).
- The newest verified local checkpoint is the resume point, and only if it belongs to this
  run key and train fingerprint (anything else is refused, never silently trained over).
- The heartbeat (`training.trainer.heartbeat`) says how far the dead attempt got past that checkpoint:
  the lost steps and seconds go into the attempts ledger before any training, so an attempt
  that dies before its first checkpoint still leaves its record.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from training.trainer.attempts import append_attempt, read_attempts
from training.trainer.checkpoint import latest_verified_state
from training.trainer.checkpoint_sync import CheckpointUploader, remote_checkpoints, restore_newer_checkpoint
from training.errors import CheckpointError
from training.trainer.heartbeat import Heartbeat, RemoteHeartbeat
from training.trainer.job import TrainJob
from training.storage.root import StorageRoot
from training.trainer.state import Progress

__all__ = ["ResumeBook"]

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
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            self.root.fetch(f"{self.job.run_rel}/attempts.jsonl")
            restore_newer_checkpoint(self.root, f"{self.job.run_rel}/checkpoints", self.ckpt_dir)
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()
        if self.rank == 0:
            self.uploader = CheckpointUploader(self.root, self.job.run_rel, self.job.run_key,
                                               self.job.config.train.keep_last)

    def latest_checkpoint(self, config_fingerprint: str) -> dict[str, Any] | None:
        """The newest verified checkpoint's state, when it belongs to this run."""
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
                seconds_lost = max(0.0, beat.train_seconds - progress.seconds["train"])
        elif beat is not None and beat.step > 0:
            # An earlier attempt died before its first checkpoint: all of it was lost.
            self.resumed_step, steps_lost, seconds_lost = 0, beat.step, beat.train_seconds
        self.heartbeat.start(progress.step, progress.seconds["train"])
        entry: dict[str, Any] = {"resumed_from": self.resumed_step, "steps_lost": steps_lost,
                                 "seconds_lost": seconds_lost, "startup_seconds": time.time() - self.spawn_time}
        records = append_attempt(self.run_dir / "attempts.jsonl", entry) if self.rank == 0 else [entry]
        # A tuning trial's pauses at its rungs are planned stops, not preemptions.
        pauses = sum(1 for e in records if "paused_at" in e)
        entries = [e for e in records if "paused_at" not in e]
        progress.resumed_from_steps = [e["resumed_from"] for e in entries if e["resumed_from"] is not None]
        progress.steps_lost = sum(e["steps_lost"] for e in entries)
        progress.seconds["lost"] = sum(e["seconds_lost"] for e in entries)
        progress.seconds["startup"] = sum(e["startup_seconds"] for e in entries)
        # An attempt killed before it got this far leaves only the launcher's count.
        progress.preemptions = max(len(entries) - 1, read_attempts(self.run_dir) - 1) - pauses

    def make_resume_point_durable(self) -> None:
        """Resumed from a local checkpoint S3 may lack (its upload was cut off): upload it."""
        if self.uploader is None or self.root is None or self.resumed_from is None:
            return
        step = self.resumed_step or 0
        remote_steps = remote_checkpoints(self.root, f"{self.job.run_rel}/checkpoints")
        if "manifest.json" not in remote_steps.get(step, {}):
            self.uploader.submit(self.resumed_from, {step})
