"""What one optimizer step of the real model costs in arithmetic, memory traffic, kernels and
held bytes, counted (not timed) on this machine: the input of `retrain plan`'s step-time model
for GPUs it has never run on.

One forward and backward at the run's micro-batch runs under PyTorch's `FlopCounterMode` (the
matmul, convolution and attention FLOPs) and a dispatch mode that sees every other ATen op: the
bytes each op reads and writes, and how many ops would launch a kernel. The tensors autograd
saves for backward are counted as they are saved. Counting is by shapes and dtypes, so a CPU
count holds for a GPU; it is repeated under bf16 autocast and with gradient checkpointing, the
variants `retrain plan` prices when a model would not fit.
"""

from __future__ import annotations

import copy
import time
import weakref
from typing import Any, Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from training.cost.cpu_step import CpuScaling
from training.cost.step_count import StepCosts, StepCount
from training.data.batch import Batch
from training.model.network import forward_fn
from training.model.objectives import Task

__all__ = ["count_step", "measure_cpu_scaling", "measure_step_costs"]

# AdamW per parameter and step: read weight, gradient and both moments, write weight and both
# moments. Its FLOPs (about a dozen per parameter) are negligible beside the model's.
ADAMW_BYTES_PER_FP32_PARAMETER = 7 * 4
# Foreach AdamW launches a handful of multi-tensor kernels per step, whatever the parameter count.
ADAMW_KERNELS = 12


class _Traffic(TorchDispatchMode):
    """Counts kernels and the bytes each one reads and writes, split by whether
    `FlopCounterMode` counts its FLOPs; and the peak of the bytes the step's own tensors hold at
    once (each output's storage from its creation until its tensor is freed)."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = 0
        self.matmul_bytes = 0.0
        self.other_bytes = 0.0
        self.alive: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def _free(self, ptr: int) -> None:
        self.live -= self.alive.pop(ptr, 0)

    def _track(self, out: Any) -> None:
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr and ptr not in self.alive:
                self.alive[ptr] = storage.nbytes()
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, ptr)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if getattr(func, "is_view", False) or func.overloadpacket in _NO_KERNEL:
            return out
        self._track(out)
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        moved = float(sum(t.numel() * t.element_size() for t in tensors))
        if func.overloadpacket in flop_registry:
            self.matmul_bytes += moved
        else:
            self.other_bytes += moved
        self.kernels += 1
        return out


_aten = torch.ops.aten
# Ops that change metadata or allocate without computing: no kernel, no traffic worth counting.
_NO_KERNEL = {_aten.detach, _aten.empty, _aten.empty_like, _aten.empty_strided, _aten.lift_fresh, _aten.set_,
              _aten.resize_, _aten.is_same_size}


def _switches(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules with a gradient-checkpointing switch (the built-in model and its text encoder)."""
    return [m for m in model.modules() if isinstance(getattr(m, "gradient_checkpointing", None), bool)]


def count_step(model: torch.nn.Module, task: Task, batch: Batch, dtype: torch.dtype | None,
               checkpointing: bool = False) -> StepCount:
    """Count one forward and backward of `model` (a copy: the run's weights, gradients and RNG
    streams are untouched) on `batch`, on the CPU."""
    probe = copy.deepcopy(model).to("cpu").train()
    for module in _switches(probe):
        module.gradient_checkpointing = checkpointing  # type: ignore[assignment]
    for module in probe.modules():
        if isinstance(getattr(module, "attention", None), str):
            module.attention = "auto"  # type: ignore[assignment]  # so the math kernel below applies
    rows = batch.map(lambda v: v.to("cpu"))
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    flops = FlopCounterMode(display=False)
    traffic = _Traffic()
    # Attention through the math kernel: its matmuls are what FlopCounterMode counts (CPU's fused
    # kernel is not in its table). A GPU's flash kernel does the same forward FLOPs without
    # materialising the scores, so the bytes counted here are an upper bound for attention.
    with torch.random.fork_rng(), sdpa_kernel([SDPBackend.MATH]), flops, traffic, \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        task.forward_loss(forward_fn(probe, model), rows, torch.device("cpu"), dtype).backward()
    params = [p for p in probe.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    return StepCount(
        micro_batch=batch.rows, precision="fp32" if dtype is None else "bf16",
        gradient_checkpointing=checkpointing, flops=float(flops.get_total_flops()),
        matmul_bytes=traffic.matmul_bytes, other_bytes=traffic.other_bytes,
        kernels=traffic.kernels + ADAMW_KERNELS, parameters=n,
        parameter_bytes=sum(p.numel() * p.element_size() for p in params),
        activation_bytes=_transient_bytes(saved, traffic.peak, rows, params),
        optimizer_bytes=float(ADAMW_BYTES_PER_FP32_PARAMETER * n))


def _transient_bytes(saved: dict[int, int], peak: int, rows: Batch, params: list[torch.nn.Parameter]) -> int:
    """Bytes a step holds beyond the weights, their gradients and AdamW's moments: the larger of
    what autograd saves for backward and the peak of the step's live tensors (which also sees
    backward's temporaries, but loses a tensor whose Python object died before its storage),
    plus the batch. Within 15 % of the measured peak RSS of a CPU step in the tests."""
    grads = sum(p.numel() * p.element_size() for p in params)
    return max(sum(saved.values()), peak - grads) + sum(v.nbytes for v in rows.values())


def measure_step_costs(model: torch.nn.Module, task: Task, batch: Batch, configured_precision: str) -> StepCosts:
    """The step as a GPU would train it under `train.precision` (auto, bf16 and fp16 run in half
    precision there; fp16 moves the bytes bf16 does), in bf16, in fp32 (autocast's casts are
    kernels of their own: a small model can run faster without them), and with gradient
    checkpointing."""
    half = torch.bfloat16
    dtype = None if configured_precision == "fp32" else half
    as_run = count_step(model, task, batch, dtype)
    bf16 = as_run if dtype is not None else count_step(model, task, batch, half)
    fp32 = as_run if dtype is None else count_step(model, task, batch, None)
    checkpointed = count_step(model, task, batch, dtype, True) if _switches(model) else None
    return StepCosts(as_run=as_run, bf16=bf16, checkpointed=checkpointed, fp32=fp32)


def measure_cpu_scaling(model: torch.nn.Module, task: Task, batch: Batch, threads: int, usable_cpus: float,
                        budget_seconds: float = 1.0, wall: Callable[[], float] = time.perf_counter,
                        cpu: Callable[[], float] = time.thread_time, rounds: int = 3) -> CpuScaling:
    """A whole training step (forward, backward and the AdamW update) of a copy of `model` on
    `batch`, on the CPU: its CPU time at one thread, which other processes' load does not
    change (a busy machine slows the wall clock, not the work), and its wall time at one thread
    and at `compare` threads (the run's, at least two, at most the usable cores), for the
    parallel share `training.cost.cpu_step` carries to other machines' cores. Each is the least
    of `rounds` interleaved timings: a round that another process slowed is left out. Nothing
    is timed where one step takes longer than `budget_seconds` (the figures are then a prior)."""
    compare = min(max(2, threads), int(usable_cpus))
    probe = copy.deepcopy(model).to("cpu").train()
    rows = batch.map(lambda v: v.to("cpu"))
    forward = forward_fn(probe, model)
    optimizer = torch.optim.AdamW(probe.parameters(), lr=1e-6, fused=True)
    before = torch.get_num_threads()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        task.forward_loss(forward, rows, torch.device("cpu"), None).backward()
        optimizer.step()

    def timed(n: int, reps: int) -> tuple[float, float]:
        """(wall, CPU) seconds a step at `n` threads."""
        torch.set_num_threads(n)
        step()  # warm-up at this count
        w0, c0 = wall(), cpu()
        for _ in range(reps):
            step()
        return (wall() - w0) / reps, (cpu() - c0) / reps

    try:
        with torch.random.fork_rng():
            first, _ = timed(1, 1)
            if first > budget_seconds:
                return CpuScaling(threads=threads)
            reps = max(1, min(8, int(budget_seconds / 4 / max(first, 1e-6))))
            ones, manys = [], []
            for _ in range(rounds):
                ones.append(timed(1, reps))
                if compare >= 2:
                    manys.append(timed(compare, reps)[0])
    finally:
        torch.set_num_threads(before)
    one_cpu = min(c for _, c in ones)
    if compare < 2:
        return CpuScaling(threads=threads, one_thread_cpu_seconds=one_cpu)
    return CpuScaling(threads=threads, compare_threads=compare, one_thread_seconds=min(w for w, _ in ones),
                      compare_seconds=min(manys), one_thread_cpu_seconds=one_cpu)
