"""`train.profile: true`: a short torch.profiler trace after wait and warm-up steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from training.protocol.results import ProfileSummary, TopOp

__all__ = ["StepProfiler"]

WAIT, WARMUP, ACTIVE = 5, 5, 10


class StepProfiler:
    """Records steps WAIT+WARMUP .. WAIT+WARMUP+ACTIVE of this attempt; then stops itself."""

    def __init__(self, out_dir: Path, device: torch.device) -> None:
        self.out_dir = out_dir
        self.trace_path = out_dir / "trace.json"
        self.top_ops: list[TopOp] = []
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self._steps = 0
        self._prof = profile(
            activities=activities,
            schedule=schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE, repeat=1),
            on_trace_ready=self._ready,
        )
        self._prof.__enter__()
        self.active = True

    def _ready(self, prof: Any) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.trace_path))
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
        self.top_ops = [TopOp(name=e.key, calls=e.count, self_cpu_ms=e.self_cpu_time_total / 1000,
                              cpu_total_ms=e.cpu_time_total / 1000) for e in events]

    def step(self) -> None:
        if not self.active:
            return
        self._prof.step()
        self._steps += 1
        if self._steps >= WAIT + WARMUP + ACTIVE:
            self.close()

    def close(self) -> None:
        if self.active:
            self._prof.__exit__(None, None, None)
            self.active = False

    def summary(self) -> ProfileSummary | None:
        if not self.top_ops:
            return None
        return ProfileSummary(trace=str(self.trace_path), steps=ACTIVE, after_steps=WAIT + WARMUP, top_ops=self.top_ops)
