"""Runs under a storage root: `runs/<run_key>/` (checkpoints/, model/, result.json, ...).

A run is finished when its result.json exists; it is published last, after the model package,
so a machine that finds it on S3 finds the model too.
"""

from __future__ import annotations

import logging
import shutil
import uuid
from pathlib import Path

from pydantic import ValidationError

from training.trainer.job import TrainJob
from training.trainer.results import RungResult, TrainResult
from training.errors import StorageError
from training.storage.files import read_json
from training.storage.root import StorageRoot

__all__ = ["RUN_FOLDERS", "fetch_finished_run", "finished_result", "paused_result", "run_rel", "rung_file"]

log = logging.getLogger(__name__)

# What a run writes into: its folder, its checkpoints, its model package, its tuning rungs.
RUN_FOLDERS = ("checkpoints", "model", "rungs")


def run_rel(run_key: str) -> str:
    return f"runs/{run_key}"


def fetch_finished_run(root: StorageRoot, rel: str) -> bool:
    """Bring down a run that finished on any machine: its result.json (published last) and its
    model package. False when the run has not finished anywhere."""
    if root.fetch(f"{rel}/result.json") is None:
        return False
    for name in ("model.json", "model.pt"):
        root.fetch(f"{rel}/model/{name}")
    return True


def finished_result(job: TrainJob) -> TrainResult | None:
    """The run's result when it already finished (on this machine or, for an s3:// root, any)."""
    if job.config.storage.is_s3 and job.run_rel:
        fetch_finished_run(StorageRoot.from_config(job.config), job.run_rel)
    path = Path(job.run_dir) / "result.json"
    try:
        finished = read_json(path)
        return None if finished is None else TrainResult.model_validate({**finished, "already_complete": True})
    except (StorageError, ValidationError, TypeError) as err:
        # Derived from the checkpoints, which are verified: set it aside and let training
        # finish the run again from its newest checkpoint (no step is trained twice).
        aside = path.with_name(f"result.json.damaged-{uuid.uuid4().hex[:8]}")
        path.rename(aside) if not path.is_dir() else shutil.rmtree(path)
        log.warning("%s is damaged (%s); set aside as %s, the run is finished again from its checkpoints", path,
                    str(err).splitlines()[0], aside.name)
        return None


def rung_file(step: int) -> str:
    """Where a run paused at a tuning rung records it, relative to the run folder."""
    return f"rungs/step-{step:08d}.json"


def paused_result(job: TrainJob, step: int) -> RungResult | None:
    """The run's pause at `step` when it got there before (here or, for an s3:// root, on any
    machine): a rung is trained once, whatever interrupts the study."""
    rel = f"{job.run_rel}/{rung_file(step)}"
    if job.config.storage.is_s3 and job.run_rel:
        StorageRoot.from_config(job.config).fetch(rel)
    paused = read_json(Path(job.run_dir) / rung_file(step))
    return None if paused is None else RungResult.model_validate(paused)
