"""End-to-end overhead of 3 hard kills (SIGKILL) against an uninterrupted run, at the default
checkpoint interval, each attempt a fresh training process as after a real spot reclaim."""

from __future__ import annotations

import signal
import struct
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import demo_parquet
from training.config import load_config
from training.errors import Preempted
from training.launch import run_training_process
from training.loop import TrainJob
from training.stages import pack_stage, preprocess_stage, run_key_for


def _job(work: Path, name: str, max_steps: int) -> TrainJob:
    source = demo_parquet(work, 200_000)
    config = load_config(overrides=[f"storage.root={work}", f"data.source={source}", f"train.max_steps={max_steps}",
                                    "train.patience=0", "model.hidden=[512, 256]"])
    packed = pack_stage(config)
    prep = preprocess_stage(packed["dataset_dir"], config.preprocess.model_dump(), str(work))
    return TrainJob(run_key_for(config, packed["fingerprint"]), str(work / "runs" / name), packed["dataset_dir"],
                    prep["stats_path"], config.model_dump(mode="json"))


def _kill_at(job: TrainJob, step: int):
    def on_start(proc) -> None:
        def watch() -> None:
            hb = Path(job.run_dir) / "heartbeat.bin"
            while proc.poll() is None:
                data = hb.read_bytes() if hb.exists() else b""
                if len(data) == 16 and struct.unpack("<qd", data)[0] >= step:
                    proc.send_signal(signal.SIGKILL)
                    return
                time.sleep(0.005)

        threading.Thread(target=watch, daemon=True).start()

    return on_start


def run(work: Path, max_steps: int = 6000) -> dict[str, Any]:
    reference_job = _job(work, "uninterrupted", max_steps)
    t0 = time.perf_counter()
    reference = run_training_process(reference_job)
    t_reference = time.perf_counter() - t0

    job = _job(work, "killed", max_steps)
    kills = [int(max_steps * f) + 37 for f in (0.25, 0.5, 0.75)]  # mid-interval, not on a checkpoint
    t0 = time.perf_counter()
    for step in kills:
        try:
            run_training_process(job, on_start=_kill_at(job, step))
        except Preempted:
            pass
    final = run_training_process(job)
    t_killed = time.perf_counter() - t0
    return {
        "max_steps": max_steps,
        "checkpoint_every": load_config().train.checkpoint_every,
        "kills_at_steps": kills,
        "uninterrupted_seconds": round(t_reference, 1),
        "with_3_kills_seconds": round(t_killed, 1),
        "overhead_fraction": round(t_killed / t_reference - 1, 3),
        "steps_lost": final["steps_lost"],
        "seconds_lost": round(final["seconds"]["lost"], 2),
        "restart_to_first_step_seconds": [round(x, 2) for x in final["restart_to_first_step_seconds"]],
        "same_model_sha256": final["model"]["sha256"] == reference["model"]["sha256"],
    }
