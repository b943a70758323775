"""Probes run once at job start that keep the accelerator fed: how many DataLoader workers the
measured data stall calls for, and the largest micro-batch that fits accelerator memory.

Both run on a copy of the model, so they leave the run's weights, optimizer and RNG streams
untouched, and a run with and without them computes the same thing.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch

from training.config import TrainConfig
from training.cost.utilization import AcceleratorStats
from training.errors import ConfigError
from training.data.batch import Batch
from training.model.network import forward_fn
from training.model.objectives import Task
from training.protocol.results import AutoBatch, WorkersProbe
from training.protocol.threads import cgroup_quota, usable_cpus

__all__ = ["accelerator_stats", "auto_batch_layout", "cuda_memory_budget", "choose_num_workers", "data_and_compute_seconds",
           "BatchSizeSearch", "find_micro_batch", "step_memory_bytes"]

log = logging.getLogger(__name__)
STALL_TARGET = 0.02  # below this share of step time spent waiting for data, workers only add IPC
MAX_WORKERS = 8


def _fwd_bwd(model: torch.nn.Module, task: Task, batch: Batch, dtype: torch.dtype | None,
             device: torch.device) -> None:
    task.forward_loss(forward_fn(model), batch.map(lambda v: v.to(device)), device, dtype).backward()


def _rows(example: Batch, n: int) -> Batch:
    """`n` rows made of the example batch's rows, repeated: real shapes and dtypes, any size."""
    have = example.rows
    index = torch.arange(n) % have
    return example.map(lambda v: v.index_select(0, index))


def _rng_untouched(device: torch.device) -> Any:
    # Dropout in the probe copy would draw from the run's generators: a resumed run would then
    # no longer be bit-identical to an uninterrupted one.
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


def choose_num_workers(model: torch.nn.Module, task: Task, fetch: Callable[[int], Batch], device: torch.device,
                       dtype: torch.dtype | None, worker_seconds: Callable[[int], float], probes: int = 8
                       ) -> WorkersProbe:
    with _rng_untouched(device):
        return _choose_num_workers(model, task, fetch, device, dtype, worker_seconds, probes)


def data_and_compute_seconds(model: torch.nn.Module, task: Task, fetch: Callable[[int], Batch],
                             device: torch.device, dtype: torch.dtype | None, probes: int = 8) -> tuple[float, float]:
    """Seconds per batch of in-process loading and of a forward/backward pass (on a copy of the
    model), each timed over `probes` batches after two of warm-up."""
    with _rng_untouched(device):
        probe_model = copy.deepcopy(model).to(device).train()
        batches = [fetch(i) for i in range(2)]  # warm-up: first shard loads, allocator
        for batch in batches:
            _fwd_bwd(probe_model, task, batch, dtype, device)
        t0 = time.perf_counter()
        batches = [fetch(i) for i in range(2, 2 + probes)]
        t_data = (time.perf_counter() - t0) / probes
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for batch in batches:
            probe_model.zero_grad(set_to_none=True)
            _fwd_bwd(probe_model, task, batch, dtype, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return t_data, (time.perf_counter() - t0) / probes


def _choose_num_workers(model: torch.nn.Module, task: Task, fetch: Callable[[int], Batch], device: torch.device,
                        dtype: torch.dtype | None, worker_seconds: Callable[[int], float], probes: int
                        ) -> WorkersProbe:
    """Workers for `train.loader.num_workers: auto`: times `probes` batch fetches and `probes`
    forward/backward passes (on a copy of the model), then `workers_for` decides."""
    t_data, t_compute = data_and_compute_seconds(model, task, fetch, device, dtype, probes)
    # A worker helps only on a core the training process leaves idle: on CPU its intra-op
    # threads take torch.get_num_threads() cores (a worker there competes with the step and
    # was measured 3.5x slower on a 2-core box); on an accelerator the process needs one.
    busy = torch.get_num_threads() if device.type == "cpu" else 1
    spare_cpus = max(0, math.floor(usable_cpus(cgroup_quota())) - busy)
    return workers_for(t_data, t_compute, spare_cpus, worker_seconds)


def workers_for(t_data: float, t_compute: float, spare_cpus: int, worker_seconds: Callable[[int], float]
                ) -> WorkersProbe:
    """The decision, from the measured seconds per batch of in-process loading (`t_data`) and
    of a forward/backward pass (`t_compute`): with no workers the loop waits `t_data` per step,
    so the stall is t_data / (t_data + t_compute). Below STALL_TARGET: 0 workers. Otherwise
    enough workers that each has a whole step of compute time to produce its batch,
    ceil(t_data / t_compute), capped by the spare cores; and only if `worker_seconds(k)`, the
    measured seconds per batch those k workers deliver, beats in-process loading (workers must
    copy every batch out of its shard and hand it over, which in-process loading never does)."""
    stall = t_data / (t_data + t_compute) if t_data + t_compute > 0 else 0.0
    workers = 0 if stall < STALL_TARGET else min(MAX_WORKERS, spare_cpus, math.ceil(t_data / max(t_compute, 1e-9)))
    t_workers = worker_seconds(workers) if workers else None
    if t_workers is not None and t_workers >= t_data:
        log.info("num_workers auto: %d workers deliver a batch in %.2g s, in-process loading in %.2g s: none used",
                 workers, t_workers, t_data)
        workers = 0
    return WorkersProbe(num_workers=workers, stall_without_workers=stall, data_seconds_per_batch=t_data,
                        compute_seconds_per_batch=t_compute, spare_cpus=spare_cpus,
                        worker_seconds_per_batch=t_workers)


def step_memory_bytes(model: torch.nn.Module, task: Task, batch: int, example: Batch, device: torch.device,
                      dtype: torch.dtype | None) -> int:
    """Bytes one training step at micro-batch `batch` needs on `device` (how: see below), with
    rows like those of `example`."""
    with _rng_untouched(device):
        return _step_memory_bytes(model, task, batch, example, device, dtype)


def _step_memory_bytes(model: torch.nn.Module, task: Task, batch: int, example: Batch, device: torch.device,
                       dtype: torch.dtype | None) -> int:
    """How the bytes are counted.

    On CUDA: the allocator's peak over a real forward/backward (gradients and activations: the
    probe's own weights are allocated before the base is read), plus the weights and AdamW's
    two moments.
    Elsewhere (CPU, or a test's simulated accelerator): parameters, gradients and AdamW's
    moments, plus every tensor autograd saves for backward, counted as they are saved."""
    probe = copy.deepcopy(model).to(device).train()
    params = sum(p.numel() * p.element_size() for p in probe.parameters())
    rows = _rows(example, batch).map(lambda v: v.to(device))
    input_bytes = sum(v.nbytes for v in rows.values())
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        _fwd_bwd(probe, task, rows, dtype, device)
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated(device) - base + 3 * params + input_bytes)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _fwd_bwd(probe, task, rows, dtype, device)
    return int(4 * params + sum(saved.values()) + input_bytes)


@dataclass
class BatchSizeSearch:
    micro_batch: int  # rows per process per micro-batch
    grad_accum: int
    max_fitting: int
    budget_bytes: int
    probes: list[tuple[int, int, bool]]  # (batch, bytes, fits)
    seconds: float


def find_micro_batch(model: torch.nn.Module, task: Task, per_rank_effective: int, example: Batch,
                     device: torch.device, dtype: torch.dtype | None, budget_bytes: int,
                     max_seconds: float = 300.0) -> BatchSizeSearch:
    """The largest micro-batch that fits `budget_bytes`, and the accumulation that keeps the
    effective batch (`per_rank_effective` rows per process per optimizer step) unchanged.

    Doubling then bisection over the measured step memory: O(log n) probes, each one step.
    The micro-batch must divide the effective batch so that every step sees exactly as many
    rows as configured (the learning rate then stays as configured)."""
    t0 = time.perf_counter()
    probes: list[tuple[int, int, bool]] = []

    def fits(b: int) -> bool:
        try:
            need = step_memory_bytes(model, task, b, example, device, dtype)
        except torch.cuda.OutOfMemoryError:
            need = budget_bytes + 1
        ok = need <= budget_bytes
        probes.append((b, need, ok))
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return ok

    if not fits(1):
        raise ConfigError(
            f"train.auto_batch_size: not even one row per micro-batch fits in {budget_bytes / 2**20:.0f} MB; "
            "use a smaller model or a larger accelerator"
        )
    lo, hi = 1, None  # lo fits; hi does not (None: not found yet)
    while hi is None and lo < per_rank_effective and time.perf_counter() - t0 < max_seconds:
        b = min(lo * 2, per_rank_effective)
        if fits(b):
            lo = b
        else:
            hi = b
    while hi is not None and hi - lo > 1 and time.perf_counter() - t0 < max_seconds:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    micro = max(d for d in range(1, lo + 1) if per_rank_effective % d == 0)
    return BatchSizeSearch(micro, per_rank_effective // micro, lo, budget_bytes, probes, time.perf_counter() - t0)


def cuda_memory_budget(free: int, reserved: int, total: int, fraction: float) -> int:
    """Bytes a run may plan its step around: `fraction` of what this process can have, which is
    the device's free memory plus what its own allocator already holds (the model's weights),
    never the device's total. Another process on the GPU (a second run, a notebook, a monitoring
    agent) holds memory that a micro-batch sized from the total would then run out of."""
    return int(min(total, free + reserved) * fraction)


def auto_batch_layout(model: torch.nn.Module, task: Task, tc: TrainConfig, example: Batch, device: torch.device,
                      dtype: torch.dtype | None, world_size: int) -> tuple[int, int, AutoBatch | None]:
    """(global micro-batch, grad_accum, search record) from the memory search on this device;
    every rank uses rank 0's choice."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = cuda_memory_budget(free, torch.cuda.memory_reserved(device), total, tc.memory_fraction)
    elif tc.simulated_memory_mb is not None:
        budget = int(tc.simulated_memory_mb * (1 << 20) * tc.memory_fraction)
    else:
        log.info("auto_batch_size: no accelerator memory to fit on %s; keeping train.batch_size", device.type)
        return tc.batch_size, tc.grad_accum, AutoBatch(skipped=f"no accelerator memory on {device.type}")
    per_rank = tc.batch_size // world_size * tc.grad_accum
    search = find_micro_batch(model, task, per_rank, example, device, dtype, budget)
    layout = [search.micro_batch, search.grad_accum]
    if world_size > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(layout, src=0)
    record = AutoBatch(micro_batch_per_process=layout[0], grad_accum=layout[1], max_fitting=search.max_fitting,
                       budget_bytes=search.budget_bytes, probes=search.probes, seconds=search.seconds)
    log.info("auto_batch_size: micro-batch %d x %d accumulation per process (largest fitting: %d rows)",
             layout[0], layout[1], search.max_fitting)
    return layout[0] * world_size, layout[1], record


def accelerator_stats(device: torch.device) -> AcceleratorStats:
    """Memory and utilisation on CUDA; "n/a" elsewhere, never invented."""
    if device.type != "cuda":
        return AcceleratorStats()
    peak = torch.cuda.max_memory_allocated(device)
    total = torch.cuda.get_device_properties(device).total_memory
    try:
        util: int | Literal["n/a"] = torch.cuda.utilization(device)  # NVML, when pynvml is installed
    except Exception:  # noqa: BLE001 - NVML missing or unsupported
        util = "n/a"
    return AcceleratorStats(memory_peak_bytes=peak, memory_total_bytes=total, memory_peak_fraction=peak / total,
                            utilization_percent=util,
                            memory_stats={k: v for k, v in torch.cuda.memory_stats(device).items()
                                          if k in ("num_alloc_retries", "num_ooms")})
