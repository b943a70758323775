"""Where the step time went, and what to do about it."""

from __future__ import annotations

from typing import Any

__all__ = ["utilization_summary"]

DATA_BOUND_STALL = 0.10
MEMORY_BOUND_PEAK = 0.90


def utilization_summary(seconds: dict[str, float], samples: int, accelerator: dict[str, Any],
                        device: str = "cuda") -> dict[str, Any]:
    """Split of step time (data wait, compute, checkpoint stall, evaluation), samples/s, the
    data-stall fraction and a bottleneck verdict with advice."""
    step_total = seconds["train"] + seconds["checkpoint"] + seconds["eval"]
    other = max(0.0, seconds["train"] - seconds["data_wait"] - seconds["compute"])  # optimizer step, bookkeeping
    split = {
        "data_wait": seconds["data_wait"],
        "compute": seconds["compute"] + other,
        "checkpoint_stall": seconds["checkpoint"],
        "evaluation": seconds["eval"],
    }
    fractions = {k: (v / step_total if step_total else 0.0) for k, v in split.items()}
    stall = seconds["data_wait"] / seconds["train"] if seconds["train"] else 0.0
    peak = accelerator.get("memory_peak_fraction")
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
        verdict, advice = "compute-bound", "the good state: the accelerator is busy; a larger train.batch_size may raise throughput"
    return {
        "seconds": split,
        "fractions": fractions,
        "samples_per_second": samples / seconds["train"] if seconds["train"] else 0.0,
        "data_stall_fraction": stall,
        "accelerator": accelerator,
        "verdict": verdict,
        "advice": advice,
    }
