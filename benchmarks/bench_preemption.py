"""End-to-end overhead of 3 hard kills (SIGKILL) against an uninterrupted run, at the default
checkpoint interval, each attempt a fresh training process as after a real spot reclaim."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

from benchmarks.common import demo_parquet, signal_at_step, train_job
from training.config import load_config
from training.errors import Preempted
from training.launch.process import run_training_process
from training.protocol.job import TrainJob


def _job(work: Path, name: str, max_steps: int) -> TrainJob:
    source = demo_parquet(work, 200_000)
    return train_job(work, name, [f"data.source={source}", f"train.max_steps={max_steps}", "train.patience=0",
                                  "model.hidden=[512, 256]"])


def run(work: Path) -> dict[str, Any]:
    # The restart cost is fixed per preemption, so the overhead shrinks as the run grows: two lengths.
    return {f"max_steps_{n}": _one(work, n) for n in (6000, 24000)}


def _one(work: Path, max_steps: int) -> dict[str, Any]:
    reference_job = _job(work, f"uninterrupted-{max_steps}", max_steps)
    t0 = time.perf_counter()
    reference = run_training_process(reference_job)
    t_reference = time.perf_counter() - t0

    job = _job(work, f"killed-{max_steps}", max_steps)
    kills = [int(max_steps * f) + 37 for f in (0.25, 0.5, 0.75)]  # mid-interval, not on a checkpoint
    t0 = time.perf_counter()
    for step in kills:
        try:
            run_training_process(job, on_start=signal_at_step(job.run_dir, step, signal.SIGKILL))
        except Preempted:
            pass
    final = run_training_process(job)
    t_killed = time.perf_counter() - t0
    return {
        "max_steps": max_steps,
        "checkpoint_every": load_config().train.checkpoint.every,
        "kills_at_steps": kills,
        "uninterrupted_seconds": round(t_reference, 1),
        "with_3_kills_seconds": round(t_killed, 1),
        "overhead_fraction": round(t_killed / t_reference - 1, 3),
        "steps_lost": final.steps_lost,
        "seconds_lost": round(final.seconds.lost, 2),
        "restart_to_first_step_seconds": [round(x, 2) for x in final.restart_to_first_step_seconds],
        "same_model_sha256": final.model.sha256 == reference.model.sha256,
    }
