"""Checkpoint stall per save of a ~100 MB state against torch.save, idle and beside a one-core
CPU burner, and restart-to-first-step.

- charged stall (the fair figure): a training loop (fwd, bwd and AdamW on an MLP, at the threads
  the project's policy picks from the measured load) runs while the background save writes;
  the time its steps took beyond the same steps without a save is the stall, so the copy, the
  writer's CPU and its contention with training are all charged. The reference is torch.save
  followed by an fsync, what a checkpoint that survives a lost machine needs.
- loop stall: the time `save()` blocks the loop, against an un-synced torch.save (the writer's
  CPU is not charged): kept to show where the charged stall comes from.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import demo_parquet, outside_load, signal_at_step, train_job
from training.trainer.checkpoint import (
    AsyncCheckpointer,
    CheckpointManifest,
    latest_verified_checkpoint,
    load_checkpoint_state,
    save_checkpoint,
)
from training.errors import Preempted
from training.launch.process import run_training_process
from training.model.network import TabularMLP

ROUNDS = 7
MIN_STEPS = 20  # the loop runs at least this many steps with a save, and until its write ends
WIDE = [2048, 2048, 2048]  # ~8.4M parameters: model + AdamW moments ~ 100 MB


def _state() -> dict[str, Any]:
    model = TabularMLP(6, [41, 4, 61, 301], WIDE)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 6), torch.zeros(4, 4, dtype=torch.long)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def _import_floor() -> float:
    """A bare interpreter importing torch and the loop: the floor of any restart."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, training.trainer.trainer"], check=True)
    return time.perf_counter() - t0


def _stall_rounds(work: Path, checkpointer: AsyncCheckpointer, state: dict[str, Any]) -> dict[str, Any]:
    """Interleaved rounds, medians with every round beside them (never the best round): each
    round times one background save's stall, a plain torch.save and a synchronous verified save."""
    stalls, plains, syncs = [], [], []
    background0, cpu0 = checkpointer.background_seconds, checkpointer.background_cpu_seconds
    for step in range(1, ROUNDS + 1):
        checkpointer.wait()  # measure the stall alone, not waiting on the previous write
        t0 = time.perf_counter()
        checkpointer.save(CheckpointManifest(step, "bench", "bench", {}), state, set())
        stalls.append(time.perf_counter() - t0)
        checkpointer.wait()  # the next two do not compete with this write
        t0 = time.perf_counter()
        torch.save(state, work / "plain.pt")
        plains.append(time.perf_counter() - t0)
        shutil.rmtree(work / "sync", ignore_errors=True)
        t0 = time.perf_counter()
        save_checkpoint(work / "sync", CheckpointManifest(1, "bench", "bench", {}), state)
        syncs.append(time.perf_counter() - t0)
    ratios = [a / b for a, b in zip(stalls, plains, strict=True)]
    return {
        "loop_stall_per_save_seconds": round(statistics.median(stalls), 4),
        "loop_stall_per_save_seconds_per_round": [round(x, 4) for x in stalls],
        "background_write_seconds": round((checkpointer.background_seconds - background0) / len(stalls), 3),
        # The writer thread's own CPU per save: on a machine with every core busy, training gives
        # up its share of that (about half beside a one-core burner on two cores).
        "background_write_cpu_seconds": round((checkpointer.background_cpu_seconds - cpu0) / len(stalls), 3),
        "synchronous_verified_save_seconds": round(statistics.median(syncs), 3),
        "plain_torch_save_seconds": round(statistics.median(plains), 3),
        "plain_torch_save_seconds_per_round": [round(x, 3) for x in plains],
        "stall_ratio_vs_torch_save": round(statistics.median(ratios), 3),
        "stall_ratio_vs_torch_save_per_round": [round(x, 3) for x in ratios],
    }


def _durable_torch_save(state: dict[str, Any], path: Path) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def _charged_rounds(work: Path, checkpointer: AsyncCheckpointer, state: dict[str, Any]) -> dict[str, Any]:
    """Interleaved rounds (which of the two loops goes first alternates): the loop with a save
    and the same steps without, and a durable torch.save."""
    from training.protocol.threads import CpuClock, apply_thread_policy

    clock = CpuClock.read()
    threads = apply_thread_policy("auto", 0, CpuClock.read_after(clock).others_busy_since(clock)).threads
    torch.manual_seed(0)
    model = TabularMLP(6, [41, 4, 61, 301], [512, 512])
    opt = torch.optim.AdamW(model.parameters())
    num, cat = torch.randn(512, 6), torch.randint(0, 4, (512, 4))

    def step() -> None:
        loss = model(num, cat).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def with_save(round_: int) -> tuple[float, int]:
        checkpointer.wait()
        t0 = time.perf_counter()
        checkpointer.save(CheckpointManifest(1000 + round_, "bench", "bench", {}), state, set())
        steps = 0
        while steps < MIN_STEPS or checkpointer.writing:
            step()
            steps += 1
        wall = time.perf_counter() - t0
        checkpointer.wait()
        return wall, steps

    def without(steps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        return time.perf_counter() - t0

    for _ in range(MIN_STEPS):
        step()  # warm the allocator and the kernels
    charged, durable, again = [], [], []
    planned = MIN_STEPS
    for r in range(ROUNDS):
        if r % 2:  # the steps without a save first, as many as the previous save took
            base_wall = without(planned)
            wall, steps = with_save(r)
            base = base_wall * steps / planned
        else:
            wall, steps = with_save(r)
            base = without(steps)
        planned = steps
        charged.append(max(0.0, wall - base))
        # The noise: the same steps without a save once more, against the first; what that
        # difference is of a durable save is how far apart the ratio's rounds land with no
        # save at all.
        again.append(abs(without(steps) - base))
        durable.append(_durable_torch_save(state, work / "durable.pt"))
    ratios = [a / b for a, b in zip(charged, durable, strict=True)]
    spreads = [a / b for a, b in zip(again, durable, strict=True)]
    return {
        "charged_threads": threads,
        "charged_stall_per_save_seconds": round(statistics.median(charged), 4),
        "charged_stall_per_save_seconds_per_round": [round(x, 4) for x in charged],
        "durable_torch_save_seconds": round(statistics.median(durable), 3),
        "durable_torch_save_seconds_per_round": [round(x, 3) for x in durable],
        "charged_stall_ratio_vs_durable_torch_save": round(statistics.median(ratios), 3),
        "charged_stall_ratio_vs_durable_torch_save_per_round": [round(x, 3) for x in ratios],
        "charged_again_spread": round(statistics.median(spreads), 3),
        "charged_again_spread_per_round": [round(x, 3) for x in spreads],
    }


def run(work: Path) -> dict[str, Any]:
    state = _state()
    state_mb = sum(t.numel() * t.element_size() for t in state["model"].values()) * 3 / 1e6
    ckpt_root = work / "ckpt"
    checkpointer = AsyncCheckpointer(ckpt_root, keep_last=2)

    idle = {**_stall_rounds(work, checkpointer, state), **_charged_rounds(work, checkpointer, state)}
    with outside_load(True):
        time.sleep(1.0)  # the burner is busy before the thread policy measures the load
        loaded = {**_stall_rounds(work, checkpointer, state), **_charged_rounds(work, checkpointer, state)}

    source = demo_parquet(work, 200_000)
    job = train_job(work, "restart", [f"data.source={source}", f"model.hidden={WIDE}", "train.max_steps=100000",
                                          "train.checkpoint.every=20", "train.eval_every=1000"])
    for stop_at in (25, 27):  # first attempt checkpoints and is stopped; the second resumes
        try:
            run_training_process(job, on_start=signal_at_step(job.run_dir, stop_at, signal.SIGTERM))
        except Preempted:
            pass
    latest = latest_verified_checkpoint(Path(job.run_dir) / "checkpoints")
    assert latest is not None, "the stopped attempts left no checkpoint"
    path, _ = latest
    restart = load_checkpoint_state(path)["run"]["restart_to_first_step_seconds"][-1]
    floor = min(_import_floor() for _ in range(3))
    return {
        "state_mb": round(state_mb, 1),
        "rounds": ROUNDS,
        **idle,
        **{f"loaded_{key}": value for key, value in loaded.items()},
        "restart_checkpoint_mb": round((path / "state.pt").stat().st_size / 1e6, 1),
        "restart_to_first_step_seconds": round(restart, 2),
        "bare_import_torch_seconds": round(floor, 2),
    }
