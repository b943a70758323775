"""Overheads: the project training loop against a bare PyTorch loop, and Prefect's orchestration
against the sum of the task bodies."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import demo_parquet, train_job
from training.config import RetrainConfig, load_config
from training.data.features import FeatureStats
from training.data.loader import ShardBatches
from training.data.packing import load_manifest
from training.loop import _lr_lambda, train
from training.model import build_model

STEPS = 1500


def _bare_loop(config: RetrainConfig, dataset_dir: str, stats_path: str) -> float:
    """Same model, AdamW, LR schedule, clipping and batches (pre-built in memory): the same math
    with no bookkeeping, the floor of any training loop."""
    torch.manual_seed(config.train.seed)
    stats = FeatureStats.from_json(Path(stats_path).read_text())
    manifest = load_manifest(Path(dataset_dir))
    batches = ShardBatches(Path(dataset_dir), manifest, "train", config.train.batch_size, stats.transformer(), seed=0)
    prebuilt = [batches.batch(0, i % batches.batches_per_epoch) for i in range(STEPS)]
    model = build_model(config.model, len(stats.numeric), stats.cardinalities)
    opt = torch.optim.AdamW(model.parameters(), lr=config.train.lr, weight_decay=config.train.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(config.train.warmup_steps, STEPS))
    model.train()
    t0 = time.perf_counter()
    for x_num, x_cat, y in prebuilt:
        opt.zero_grad(set_to_none=True)
        F.binary_cross_entropy_with_logits(model(x_num, x_cat), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.train.grad_clip)
        opt.step()
        sched.step()
    return time.perf_counter() - t0


def _project_loop(work: Path, name: str, overrides: list[str]) -> dict[str, Any]:
    job = train_job(work, name, overrides)
    result = train(job)
    s = result["seconds"]
    # Loop time with the data wait taken out (the bare loop's batches are pre-built), but with
    # validation and checkpoint stalls in, as a user pays them.
    return {"seconds": s["train"] - s["data_wait"] + s["checkpoint"] + s["eval"], "data_wait": s["data_wait"],
            "checkpoints": result["checkpoints_saved"]}


def _prefect_overhead(work: Path, source: Path) -> dict[str, Any]:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    from flows.retrain import retrain

    def config(seed: int) -> RetrainConfig:
        return load_config(overrides=[f"storage.root={work / 'flow'}", f"data.source={source}", f"train.seed={seed}"])

    retrain(config(1))  # starts the ephemeral server: the one-off cost is not orchestration overhead
    t0 = time.perf_counter()
    report = json.loads(Path(retrain(config(2))).read_text())
    wall = time.perf_counter() - t0
    bodies = sum(report["durations"].values())
    return {"flow_wall_seconds": round(wall, 2), "task_bodies_seconds": round(bodies, 2),
            "prefect_overhead_fraction": round(wall / bodies - 1, 3),
            "demo_data_stall_fraction": round(report["utilization"]["data_stall_fraction"], 4)}


def run(work: Path) -> dict[str, Any]:
    source = demo_parquet(work, 200_000)
    base = [f"data.source={source}", f"train.max_steps={STEPS}", "train.patience=0"]
    job = train_job(work, "probe", base)
    bare = min(_bare_loop(load_config(overrides=base), job.dataset_dir, job.stats_path) for _ in range(2))
    quiet_overrides = base + [f"train.eval_every={STEPS}", f"train.checkpoint_every={STEPS}"]
    quiet = min((_project_loop(work, f"quiet{i}", quiet_overrides) for i in range(2)), key=lambda r: r["seconds"])
    # Checkpoints at the default interval (every 200 steps), validation still only at the end.
    ckpt_overrides = base + [f"train.eval_every={STEPS}"]
    default = min((_project_loop(work, f"ckpt{i}", ckpt_overrides) for i in range(2)), key=lambda r: r["seconds"])
    out = {
        "steps": STEPS,
        "bare_loop_seconds": round(bare, 3),
        "project_loop_seconds_no_eval_no_checkpoints": round(quiet["seconds"], 3),
        "loop_overhead_fraction": round(quiet["seconds"] / bare - 1, 3),
        "project_loop_seconds_checkpoint_every_200": round(default["seconds"], 3),
        "checkpoints_saved": default["checkpoints"],
        "checkpointing_overhead_fraction": round(default["seconds"] / quiet["seconds"] - 1, 3),
    }
    out.update(_prefect_overhead(work, source))
    return out
