"""A cloud CPU instance's step time, from the step measured where `retrain plan` runs.

The calibration times a whole step (forward, backward, the AdamW update) of the real model on
a micro-batch: its CPU time at one thread, t(1), and its wall time at one thread and at two or
more (`CpuScaling`), each the least of interleaved rounds. t(1) is CPU time, so another
process's load does not change it: a busy machine slows the wall clock, not the work, and a plan
on a busy CI runner prices the same step as on a quiet laptop. Amdahl's law with the parallel
share the two wall times imply carries the step to the instance's cores:

    t(c) = t(1) * ((1 - p) + p / c)

where c is the physical cores the instance gives the training process (half its vCPUs, which
are hyperthreads on every x86 type in the price table, less one core for the loader once there
are two or more). The parallel share is known only from the cores here, so the range widens it
by `SHARE_SPREAD`, and a core there is taken as fast as one here within `CORE_SPEED_SPREAD`
(`cost.prices.<type>.relative_speed` moves the middle). Without a two-thread measurement (a one-
core machine, or a step too long to time twice) the share is a prior, `PRIOR_SHARE`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["CpuScaling", "CpuStep", "PRIOR_SHARE", "cores_for_training", "parallel_share", "predict_cpu_step"]

PRIOR_SHARE = 0.5  # an assumption, used only where nothing was measured
SHARE_SPREAD = 0.15
CORE_SPEED_SPREAD = 0.15


class CpuScaling(BaseModel):
    """One forward and backward of the real model timed here at one thread and at `threads`."""

    model_config = ConfigDict(frozen=True)

    threads: int  # the intra-op threads of the calibration's steps
    compare_threads: int | None = None  # the threads timed against one; None: not measured
    one_thread_seconds: float | None = None  # wall, for the parallel share
    compare_seconds: float | None = None
    one_thread_cpu_seconds: float | None = None  # CPU time of a step at one thread: the load-free t(1)


class CpuStep(BaseModel):
    model_config = ConfigDict(frozen=True)

    low: float
    mid: float
    high: float
    cores: int  # physical cores the instance gives intra-op threads
    share: float  # the parallel share used at the middle estimate
    measured_share: bool
    from_cpu_time: bool = False  # t(1) is the step's CPU time (else this machine's wall time)


def parallel_share(scaling: CpuScaling | None) -> tuple[float, bool]:
    """(the parallel share p, whether it was measured)."""
    if scaling is None or not scaling.compare_threads or not scaling.one_thread_seconds or not scaling.compare_seconds:
        return PRIOR_SHARE, False
    speedup = scaling.one_thread_seconds / scaling.compare_seconds
    c = scaling.compare_threads
    share = (1 - 1 / speedup) / (1 - 1 / c) if c > 1 and speedup > 0 else PRIOR_SHARE
    return min(0.98, max(0.0, share)), True


def cores_for_training(vcpus: int) -> int:
    """Physical cores for the intra-op threads: half the vCPUs, one kept for the loader."""
    physical = max(1, vcpus // 2)
    return physical - 1 if physical > 1 else 1


def _amdahl(share: float, cores: int) -> float:
    return (1 - share) + share / max(1, cores)


def predict_cpu_step(here_seconds: float, scaling: CpuScaling | None, vcpus: int, relative_speed: float,
                     micro_batches: int = 1) -> CpuStep:
    """The step time on an instance with `vcpus`: from the one-thread CPU time of a step where
    it was measured, else (an older calibration) from `here_seconds` per step, the wall time
    measured here. `micro_batches`: a step's (the CPU time is of one)."""
    share, measured = parallel_share(scaling)
    here_threads = scaling.threads if scaling is not None else 1
    cores = cores_for_training(vcpus)
    cpu_time = scaling.one_thread_cpu_seconds if scaling is not None else None

    def at(p: float, speed: float) -> float:
        one_thread = cpu_time * micro_batches if cpu_time else here_seconds / _amdahl(p, here_threads)
        return one_thread * _amdahl(p, cores) / (relative_speed * speed)

    # More cores than here: a larger share is the optimistic end; fewer: the pessimistic one.
    more = cores >= here_threads
    hi_share, lo_share = min(0.98, share + SHARE_SPREAD), max(0.0, share - SHARE_SPREAD)
    low = at(hi_share if more else lo_share, 1 + CORE_SPEED_SPREAD)
    high = at(lo_share if more else hi_share, 1 - CORE_SPEED_SPREAD)
    return CpuStep(low=min(low, high), mid=at(share, 1.0), high=max(low, high), cores=cores, share=share,
                   measured_share=measured, from_cpu_time=bool(cpu_time))
