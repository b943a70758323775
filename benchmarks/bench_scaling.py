"""Data-parallel scaling: samples/s of the same job (same global batch) on 1 and 2 processes
under torchrun (gloo, CPU), against 2x the single-process figure, next to an all-reduce
estimate: one all-reduce of the model's gradient, timed alone on the same transport.

On a 2-core machine two processes also split the cores, so this measures the cost of DDP's
machinery on one box, not the speed-up of adding a GPU.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import demo_parquet, train_job

STEPS = 300
GLOBAL_BATCH = 2048


def _allreduce_worker(rank: int, port: int, numel: int, out: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    t = torch.ones(numel)
    for _ in range(3):
        dist.all_reduce(t)
    dist.barrier()
    t0 = time.perf_counter()
    n = 20
    for _ in range(n):
        dist.all_reduce(t)
    if rank == 0:
        out.put((time.perf_counter() - t0) / n)
    dist.destroy_process_group()


def _allreduce_seconds(numel: int) -> float:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, port, numel, queue)) for r in range(2)]
    for p in procs:
        p.start()
    seconds = queue.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
    return float(seconds)


def run(work: Path) -> dict[str, Any]:
    from training.launch.process import run_training_process

    source = demo_parquet(work, 200_000)
    common = [f"data.source={source}", f"train.max_steps={STEPS}", f"train.batch_size={GLOBAL_BATCH}",
              "train.eval_every=100000", "train.checkpoint.every=100000", "train.patience=0"]
    rates = {}
    results = {}
    for nproc in (1, 2):
        job = train_job(work / f"n{nproc}", f"n{nproc}", [*common, f"train.distributed.nproc_per_node={nproc}"])
        result = run_training_process(job)
        seconds = result.seconds.train
        rates[nproc] = STEPS * GLOBAL_BATCH / seconds
        results[nproc] = result
    params = torch.load(results[1].model.uri, weights_only=True)
    numel = sum(t.numel() for t in params.values())
    grad_bytes = numel * 4
    measured = _allreduce_seconds(numel)
    # The estimate: one all-reduce of the gradient per step, taken from the measured time of
    # that all-reduce alone; 2 x its time bounds what 2 processes can lose to communication.
    step_seconds_2 = GLOBAL_BATCH / rates[2]
    w1, w2 = params, torch.load(results[2].model.uri, weights_only=True)
    return {
        "global_batch": GLOBAL_BATCH,
        "steps": STEPS,
        "samples_per_s_1_process": round(rates[1]),
        "samples_per_s_2_processes": round(rates[2]),
        "scaling_efficiency_2_processes": round(rates[2] / (2 * rates[1]), 3),
        "gradient_mb": round(grad_bytes / 1e6, 3),
        "allreduce_ms_measured_gloo_loopback": round(measured * 1000, 3),
        "step_ms_2_processes": round(step_seconds_2 * 1000, 3),
        "allreduce_share_of_2_process_step": round(measured / step_seconds_2, 3),
        "efficiency_estimate_if_only_allreduce_cost": round(1 / (1 + measured / (step_seconds_2 - measured)), 3),
        "max_weight_diff_1_vs_2_processes": float(max((w1[k].double() - w2[k].double()).abs().max().item() for k in w1)),
        "val_auc_1_vs_2_processes": [results[1].best_val_auc, results[2].best_val_auc],
    }
