"""`train(job)`: run, resume, or find already finished the training run of a job.

The work is the `Trainer`'s (`training.trainer.trainer`); this entry point only answers a finished run
from its result.json (here or on S3) without building anything.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from training.trainer.job import TrainJob
from training.trainer.results import RungResult, TrainResult
from training.trainer.runs import finished_result, paused_result
from training.trainer.stopping import StopFlag
from training.trainer.trainer import Trainer

__all__ = ["StopFlag", "train"]


def train(job: TrainJob, stop: StopFlag | None = None, emit: Callable[[dict[str, Any]], None] = lambda event: None,
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
    return Trainer(job, stop, emit, rank, world_size, now_fn).fit()
