"""Device and precision choice."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from training.protocol.numerics import device_for, precision_for

if TYPE_CHECKING:
    from training.data.batch import Batch
    from training.model.objectives import Task

__all__ = ["autocast_dtype", "measure_fp32_slowdown", "resolve_device", "resolve_precision", "time_precisions"]

log = logging.getLogger(__name__)


def resolve_device(requested: str) -> torch.device:
    return torch.device(device_for(requested, torch.cuda.is_available()))


def resolve_precision(requested: str, device: torch.device) -> str:
    """`train.precision` on `device`, by the rules of `training.protocol.numerics`."""
    native = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
    return precision_for(requested, device.type, native)


def autocast_dtype(precision: str) -> torch.dtype | None:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


def measure_fp32_slowdown(model: torch.nn.Module, task: Task, batch: Batch, device: torch.device, precision: str,
                          steps: int = 10) -> float:
    """fp32 step time over this run's precision, timed on a copy of the model (for the naive
    counterfactual in the cost report).

    The run's micro-batch may have been sized to fill the accelerator in bf16 (auto batch size),
    so the fp32 copy at that size can run out of memory after training has finished: the timing
    then halves the rows until it fits, and with not even one row fitting it reports no slowdown
    (1.0) rather than fail a finished run."""
    rows = batch.rows
    while rows >= 1:
        try:
            return _fp32_slowdown(batch.slice(0, rows), model, task, device, precision, steps)
        except torch.cuda.OutOfMemoryError:
            if device.type == "cuda":
                torch.cuda.empty_cache()
            log.warning("fp32 re-timing: %d rows do not fit beside the run in fp32; trying %d", rows, rows // 2)
            rows //= 2
    log.warning("fp32 re-timing: no fp32 step fits beside the run; the cost report assumes no slowdown")
    return 1.0


def _fp32_slowdown(batch: Batch, model: torch.nn.Module, task: Task, device: torch.device, precision: str,
                   steps: int) -> float:
    import copy

    from training.model.network import forward_fn

    rows = batch.map(lambda v: v.to(device))

    def timed(dtype: torch.dtype | None) -> float:
        m = copy.deepcopy(model).train()
        forward = forward_fn(m)
        t0 = time.perf_counter()
        for i in range(steps + 3):  # 3 warm-up steps
            if i == 3:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
            m.zero_grad(set_to_none=True)  # one set of gradients alive, as in the run
            task.forward_loss(forward, rows, device, dtype).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    return timed(None) / timed(autocast_dtype(precision))


def time_precisions(model: torch.nn.Module, task: Task, batch: Batch, device: torch.device,
                    precisions: tuple[str, ...] = ("fp32", "bf16"), steps: int = 8,
                    rounds: int = 3) -> dict[str, list[float]]:
    """Seconds per forward and backward of `batch` in each precision, on a copy of the model:
    `rounds` timings of `steps` steps each, the precisions interleaved round by round (so a
    change in the machine's load falls on both), after warm-up steps. `train.precision: auto`
    on a GPU picks by these (`training.pipeline.precision_pick`): bf16 runs fewer bytes
    through the tensor cores, but autocast adds a cast kernel per weight, which a small model
    bound by kernel launches pays for in full (the default MLP ran 1.27x faster in fp32 on an
    H200)."""
    import copy

    from training.model.network import forward_fn

    rows = batch.map(lambda v: v.to(device))
    m = copy.deepcopy(model).train()
    forward = forward_fn(m)

    def run(precision: str, n: int) -> float:
        dtype = autocast_dtype(precision)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(n):
            m.zero_grad(set_to_none=True)
            task.forward_loss(forward, rows, device, dtype).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) / n

    for precision in precisions:
        run(precision, 3)  # warm-up: kernels chosen, allocator settled
    times: dict[str, list[float]] = {p: [] for p in precisions}
    for r in range(rounds):
        for precision in (precisions if r % 2 == 0 else precisions[::-1]):
            times[precision].append(run(precision, steps))
    return times
