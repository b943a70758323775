"""Shared helpers: timing, a machine description, and the demo data at a chosen size."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Callable

import torch

from training.data.demo import ensure_demo_dataset


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
