"""`train(job)`: the training process's one entry. It trains the run in `job.run_dir` (or
finds it finished, or paused at the rung it asks for), then publishes what the Trainer made:
the model package and result.json at the end, a rung's record at a pause."""

from __future__ import annotations

import time
from typing import Callable

from training.protocol.events import ChildEvent
from training.protocol.job import TrainJob
from training.protocol.results import RungResult, TrainResult
from training.protocol.runs import finished_result, paused_result
from training.trainer.publish import finish_run, pause_run
from training.trainer.stopping import StopFlag
from training.trainer.trainer import Trainer

__all__ = ["StopFlag", "train"]


def train(job: TrainJob, stop: StopFlag | None = None, emit: Callable[[ChildEvent], None] = lambda event: None,
          rank: int = 0, world_size: int = 1, now_fn: Callable[[], float] = time.perf_counter
          ) -> TrainResult | RungResult | None:
    """Train (or resume, or find already finished) the run in `job.run_dir`; its result (or its
    pause at `job.pause_at`) on rank 0, None on the other ranks."""
    finished = finished_result(job)
    if finished is not None:
        return finished
    paused = paused_result(job, job.pause_at) if job.pause_at is not None else None
    if paused is not None:
        return paused  # this rung was reached before: nothing to train
    trainer = Trainer(job, stop, emit, rank, world_size, now_fn)
    status = trainer.fit()
    if rank != 0:
        return None
    return pause_run(trainer) if status == "paused" else finish_run(trainer, status)
