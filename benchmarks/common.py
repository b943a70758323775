"""Shared helpers: timing, a machine description, and the demo data at a chosen size."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import platform
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

from training.data.ingest.demo import ensure_demo_dataset


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()} cores, {cpu}, {gpu}, Python {platform.python_version()}, torch {torch.__version__}"


def best_of(fn: Callable[[], object], repeat: int = 3) -> float:
    """Best wall time of `repeat` runs: the least disturbed by other load on a shared box."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def demo_parquet(work: Path, rows: int) -> Path:
    path, _ = ensure_demo_dataset(work, rows=rows, seed=1)
    return path


def train_job(work: Path, name: str, overrides: list[str]):
    """A packed, preprocessed training job under `work`, as the flow would build it."""
    from training.config import load_config
    from training.protocol.job import TrainJob
    from training.pipeline.pack_stage import pack_stage
    from training.pipeline.preprocess_stage import preprocess_stage
    from training.pipeline.train_stage import run_key_for

    config = load_config(overrides=[f"storage.root={work}", *overrides])
    packed = pack_stage(config)
    prep = preprocess_stage(packed.dataset_dir, config.preprocess, config.storage)
    return TrainJob(run_key_for(config, packed.fingerprint), str(work / "runs" / name), packed.dataset_dir,
                    prep.stats_path, config)


def signal_at_step(run_dir: str, step: int, sig: int):
    """on_start callback for run_training_process: send `sig` once this attempt passed `step`."""
    import struct
    import threading

    def on_start(proc) -> None:
        started = time.time()

        def watch() -> None:
            hb = Path(run_dir) / "heartbeat.bin"
            while proc.poll() is None:
                fresh = hb.exists() and hb.stat().st_mtime >= started
                data = hb.read_bytes() if fresh else b""
                if len(data) == 16 and struct.unpack("<qd", data)[0] >= step:
                    proc.send_signal(sig)
                    return
                time.sleep(0.005)

        threading.Thread(target=watch, daemon=True).start()

    return on_start


def _burn() -> None:
    while True:
        pass


@contextlib.contextmanager
def outside_load(on: bool) -> Iterator[None]:
    """One process spinning on a core, as another job on a shared box would."""
    if not on:
        yield
        return
    burner = multiprocessing.get_context("spawn").Process(target=_burn, daemon=True)
    burner.start()
    try:
        yield
    finally:
        burner.kill()
        burner.join()
