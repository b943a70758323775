"""A GPU's step time for a counted step (`training.trainer.step_cost`), from its published figures.

Per step: the matmul-class ops take the longer of their FLOPs at the precision's peak and their
bytes at the memory bandwidth (a roofline); every other kernel is bandwidth-bound; AdamW streams
the weights, gradients and moments once; and each kernel costs the host its launch. An eager
step runs the host ahead of the GPU, which queues its kernels: the step takes the longer of the
host's launches and the GPU's work, not their sum. fp16 is the exception: its GradScaler reads
back whether the gradients overflowed at every step, a sync that stops the host from running
ahead, so there the two add up. Peaks are
never reached, so each term is scaled by an efficiency. The host's cost per kernel is measured
(`python -m benchmarks.run gpu`, benchmarks/results/gpu.json); the compute and bandwidth
efficiencies are priors, because every built-in model measured there was host-bound. The three
sets give every prediction a low-high range, and a step time measured on an instance replaces
the prediction (`cost.prices.<type>.measured_step_seconds`).
"""

from __future__ import annotations

from pydantic import BaseModel

from training.cost.hardware import GpuSpec, peak_flops
from training.cost.step_count import StepCount

__all__ = ["Efficiency", "PRIORS", "StepPrediction", "predict_step", "training_bytes"]


class Efficiency(BaseModel):
    compute: float  # fraction of peak FLOP/s the matmuls reach
    bandwidth: float  # fraction of peak bandwidth the memory-bound kernels reach
    launch_seconds: float  # host seconds per counted kernel, eager mode


# Optimistic, middle, pessimistic. Small tabular matmuls reach a modest share of peak. The host
# cost per kernel is what one eager bf16 training step took per counted kernel on a GPU, less
# the step's compute and memory terms: 43 us (tabular MLP, 77 kernels), 35 us (text
# transformer, 247) and 43 us (image CNN, 78) on an H200 with a 16-core Xeon host
# (benchmarks/results/gpu.json, parts plan_*). It covers Python, dispatch and autograd, not only
# the launch itself, which is why it is several times a bare launch. Low and high allow for faster
# and slower hosts.
PRIORS = (Efficiency(compute=0.7, bandwidth=0.85, launch_seconds=30e-6),
          Efficiency(compute=0.45, bandwidth=0.7, launch_seconds=40e-6),
          Efficiency(compute=0.25, bandwidth=0.5, launch_seconds=60e-6))
# Gradients of a multi-GPU instance are all-reduced over its links each step: 10-100 GB/s
# (PCIe to NVLink), an assumption like the priors.
ALLREDUCE_GBS = (100.0, 25.0, 10.0)
# Beside the model's own bytes a GPU holds the CUDA context and the caching allocator's slack; an
# allowance, not a measurement (no GPU here): PyTorch's context alone is several hundred MB.
CUDA_OVERHEAD_BYTES = 1.5e9


class StepPrediction(BaseModel):
    low: float
    mid: float
    high: float
    precision: str  # what the step runs in on this GPU
    bound: str  # the largest term at the middle estimate: compute, memory or launch


def _seconds(count: StepCount, gpu: GpuSpec, gpus: int, peak: float, eff: Efficiency, link_gbs: float,
             synced: bool) -> tuple[float, dict[str, float]]:
    bw = gpu.bandwidth_gbs * 1e9 * eff.bandwidth
    share = 1.0 / gpus  # data parallel: each GPU takes 1/gpus of the rows, every kernel still launches
    matmul = max(count.flops * share / (peak * eff.compute), count.matmul_bytes * share / bw)
    memory = (count.other_bytes * share + count.optimizer_bytes) / bw
    launch = count.kernels * eff.launch_seconds
    comm = 0.0 if gpus == 1 else 2 * (gpus - 1) / gpus * count.parameter_bytes / (link_gbs * 1e9)
    parts = {"compute": matmul, "memory": memory + comm, "launch": launch}
    device = matmul + memory + comm
    return (launch + device if synced else max(launch, device)), parts


def predict_step(count: StepCount, gpu: GpuSpec, gpus: int, precision: str) -> StepPrediction:
    """Seconds per optimizer step of `count` on an instance with `gpus` of `gpu`."""
    peak, runs_in = peak_flops(gpu, precision)
    synced = runs_in == "fp16"  # the GradScaler's per-step read-back (see the module)
    low, _ = _seconds(count, gpu, gpus, peak, PRIORS[0], ALLREDUCE_GBS[0], synced)
    mid, parts = _seconds(count, gpu, gpus, peak, PRIORS[1], ALLREDUCE_GBS[1], synced)
    high, _ = _seconds(count, gpu, gpus, peak, PRIORS[2], ALLREDUCE_GBS[2], synced)
    return StepPrediction(low=low, mid=mid, high=high, precision=runs_in, bound=max(parts, key=lambda k: parts[k]))


def training_bytes(count: StepCount, gpus: int) -> float:
    """What one GPU holds: fp32 weights, gradients and AdamW's two moments, its share of the
    activations, and the CUDA allowance."""
    return 4 * count.parameter_bytes + count.activation_bytes / gpus + CUDA_OVERHEAD_BYTES
