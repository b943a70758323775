"""Where the step time went, and what to do about it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

__all__ = ["AcceleratorStats", "TimeSplit", "Utilization", "utilization_summary"]

DATA_BOUND_STALL = 0.10
MEMORY_BOUND_PEAK = 0.90
FP32_FASTER = 0.95  # an fp32 step this much faster than the run's mixed-precision one is worth advising


class TimeSplit(BaseModel):
    """Where training time went (seconds, or shares of the total)."""

    model_config = ConfigDict(extra="ignore")

    data_wait: float
    compute: float
    checkpoint_stall: float
    evaluation: float

    def items(self) -> list[tuple[str, float]]:
        return list(self.model_dump().items())


NotMeasured = Literal["n/a"]


class AcceleratorStats(BaseModel):
    """The training device's memory and utilisation as torch.cuda and NVML measured them; "n/a"
    where nothing measures them (a CPU, a GPU without NVML), never invented."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    memory_peak_bytes: int | NotMeasured = "n/a"
    memory_total_bytes: int | NotMeasured = "n/a"
    memory_peak_fraction: float | NotMeasured = "n/a"
    utilization_percent: int | NotMeasured = "n/a"
    memory_stats: dict[str, int] = {}  # the allocator's retries and out-of-memory counts


class Utilization(BaseModel):
    """report.json's `utilization`: the split, the pace, and the bottleneck with advice."""

    model_config = ConfigDict(extra="ignore")

    seconds: TimeSplit
    fractions: TimeSplit
    samples_per_second: float
    data_stall_fraction: float
    accelerator: AcceleratorStats
    verdict: str
    advice: str


def utilization_summary(train: float, data_wait: float, compute: float, checkpoint: float, evaluation: float,
                        samples: int, accelerator: AcceleratorStats, device: str = "cuda", precision: str = "fp32",
                        fp32_slowdown: float | None = 1.0) -> Utilization:
    """Split of step time (data wait, compute, checkpoint stall, evaluation), samples/s, the
    data-stall fraction and a bottleneck verdict with advice; `train` is the steps' wall time,
    of which `data_wait` and `compute` were measured inside the step. `fp32_slowdown` is the
    run's measured fp32 step time over its own (1.0 for an fp32 run; None: not measured)."""
    step_total = train + checkpoint + evaluation
    other = max(0.0, train - data_wait - compute)  # optimizer step, bookkeeping
    split = TimeSplit(data_wait=data_wait, compute=compute + other, checkpoint_stall=checkpoint, evaluation=evaluation)
    fractions = TimeSplit(**{k: (v / step_total if step_total else 0.0) for k, v in split.items()})
    stall = data_wait / train if train else 0.0
    peak = accelerator.memory_peak_fraction
    # Worded for the device used: on a CPU there is no accelerator to keep busy or to feed.
    unit = "the CPU" if device == "cpu" else "the accelerator"
    if stall > DATA_BOUND_STALL:
        verdict, advice = "data-bound", (f"{unit} waits for data: raise train.loader.num_workers"
                                         f"{', pin memory' if device != 'cpu' else ''}, pack the data into fewer, "
                                         "larger members")
    elif isinstance(peak, float) and peak > MEMORY_BOUND_PEAK:
        verdict, advice = "memory-bound", "accelerator memory is nearly full: enable model.gradient_checkpointing or lower train.batch_size and raise train.grad_accum"
    elif device == "cpu":
        verdict, advice = "compute-bound", ("the CPU cores are busy with the model's arithmetic; a GPU, or more "
                                            "cores, is what would raise throughput")
    else:
        # Not "the accelerator is busy": nothing here measures that. A small model's step on a
        # modern GPU is mostly the host launching kernels (benchmarks/results/gpu.json's busy
        # fraction of a tabular run), which more rows per step or a compiled graph amortise.
        verdict, advice = "compute-bound", ("the step itself sets the pace, not the data; on a GPU a small model's "
                                            "step is mostly the host launching kernels (retrain plan shows what "
                                            "bounds it): a larger train.batch_size or train.compile raises throughput")
    if precision in ("bf16", "fp16") and fp32_slowdown is not None and fp32_slowdown < FP32_FASTER:
        # Autocast adds cast kernels; where launches dominate, they cost more than the faster math saves.
        advice += (f"; an fp32 step took {fp32_slowdown:.2f}x this run's {precision} step, so this model trains "
                   "faster with train.precision: fp32")
    return Utilization(seconds=split, fractions=fractions, samples_per_second=samples / train if train else 0.0,
                       data_stall_fraction=stall, accelerator=accelerator, verdict=verdict, advice=advice)
