"""Overheads: the project training loop against a bare PyTorch loop, and Prefect's orchestration
against the sum of the task bodies.

The loop: the same model, AdamW (the same implementation, `train.optim.fused`), schedule and
clipping over the same batches; the bare loop's are
pre-built in memory, the project's come through its loader, from a dataset of several train
shards (2 MB each), so the shards read after start-up are waited for inside the timed loop.
The headline is the overhead at the same thread count (the project's policy's), the project's
loop bracketed by two bare loops; the bare loop at torch's default threads is shown too (a
hand-written loop's setting, which thrashes beside a burner). Medians of per-round ratios.
The two bare loops of a round are the same work twice: how far apart they land (the median of
|after / before - 1|) is the noise floor below which the overhead cannot be told from nothing.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from benchmarks.common import demo_parquet, outside_load, train_job
from training.config import RetrainConfig, load_config
from training.data.prepare.features import FeatureStats
from training.data.load.loader import ShardBatches
from training.data.manifest import require_manifest
from training.protocol.results import TrainResult
from training.trainer.run import train
from training.model.spec import lr_lambda as _lr_lambda
from training.model.network import ModelSchema
from training.model.spec import build_model

STEPS = 1500
DEFAULT_THREADS = torch.get_num_threads()


def _bare_loop(config: RetrainConfig, dataset_dir: str, stats_path: str) -> float:
    """Same model, AdamW, LR schedule, clipping and batches (pre-built in memory): the same math
    with no bookkeeping, the floor of any training loop."""
    torch.manual_seed(config.train.seed)
    stats = FeatureStats.from_json(Path(stats_path).read_text())
    manifest = require_manifest(Path(dataset_dir))
    batches = ShardBatches(Path(dataset_dir), manifest, "train", config.train.batch_size, stats.transformer(), seed=0)
    prebuilt = [batches.batch(0, i % batches.batches_per_epoch) for i in range(STEPS)]
    model = build_model(config.model, ModelSchema.of(stats))
    # The project's AdamW implementation (its fused kernel by default): the overhead is the loop's, not the optimiser's.
    opt = torch.optim.AdamW(model.parameters(), lr=config.train.optim.lr, weight_decay=config.train.optim.weight_decay,
                            fused=config.train.optim.fused or None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(config.train.schedule.warmup_steps, STEPS))
    model.train()
    t0 = time.perf_counter()
    for batch in prebuilt:
        opt.zero_grad(set_to_none=True)
        F.binary_cross_entropy_with_logits(model(batch), batch["label"]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.train.optim.grad_clip)
        opt.step()
        sched.step()
    return time.perf_counter() - t0


def _project_loop(work: Path, name: str, overrides: list[str]) -> dict[str, Any]:
    job = train_job(work, name, overrides)
    result = train(job)
    assert isinstance(result, TrainResult), result
    s = result.seconds
    policy = result.threads
    # Loop time as a user pays it: the data wait in (the bare loop's batches are pre-built, so
    # a loader stall shows here and nowhere else), and the validation and checkpoint stalls.
    # With it, what the thread policy measured as it set up: the cores other processes kept busy.
    return {"seconds": s.train + s.checkpoint + s.eval, "data_wait": s.data_wait,
            "checkpoints": result.checkpoints_saved,
            "others_busy": round(policy.others_busy, 2) if policy is not None else None}


def _task_run_seconds(flow_run_id: Any) -> float:
    """Sum of the time Prefect recorded each of the flow run's task runs in Running: the task
    bodies, every task (the report's own rendering included), as the server saw them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return sum(run.total_run_time.total_seconds() for run in runs)


def _prefect_overhead(work: Path, source: Path, rounds: int) -> dict[str, Any]:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    from flows.retrain import retrain

    def config(seed: int) -> RetrainConfig:
        return load_config(overrides=[f"storage.root={work / 'flow'}", f"data.source={source}", f"train.seed={seed}"])

    from prefect.server.api.server import SubprocessASGIServer

    walls, bodies, stalls = [], [], []
    try:
        retrain(config(1))  # starts the ephemeral server: the one-off cost is not orchestration overhead
        for r in range(rounds):
            t0 = time.perf_counter()
            state = retrain(config(2 + r), return_state=True)
            walls.append(time.perf_counter() - t0)
            report = json.loads(Path(state.result()).read_text())
            bodies.append(_task_run_seconds(state.state_details.flow_run_id))
            stalls.append(report["utilization"]["data_stall_fraction"])
    finally:
        # Prefect keeps its ephemeral server until this process exits: the benchmarks that run
        # after this one in the same `benchmarks.run` must not share the machine with it.
        SubprocessASGIServer().stop()
    fractions = [w / b - 1 for w, b in zip(walls, bodies, strict=True)]
    return {"flow_wall_seconds": [round(w, 2) for w in walls], "task_bodies_seconds": [round(b, 2) for b in bodies],
            "prefect_overhead_fraction_per_round": [round(f, 3) for f in fractions],
            "prefect_overhead_fraction": round(statistics.median(fractions), 3),
            "demo_data_stall_fraction_per_round": [round(x, 4) for x in stalls],
            "demo_data_stall_fraction": round(statistics.median(stalls), 4)}


def _run_end(end: str, work: Path, name: str, ckpt_overrides: list[str], bare: list[float],
             ckpt: list[dict[str, Any]], bare_at: Callable[[int], float]) -> None:
    """One of the loops a round runs before or after the bracketed project loop."""
    if end == "bare":
        bare.append(bare_at(DEFAULT_THREADS))  # what a hand-written loop gets
    else:
        ckpt.append(_project_loop(work, f"ckpt-{name}", ckpt_overrides))


def _loop_rounds(work: Path, job: Any, base: list[str], rounds: int, load: bool) -> dict[str, Any]:
    quiet_overrides = base + [f"train.eval_every={STEPS}", f"train.checkpoint.every={STEPS}"]
    # Checkpoints at the default interval (every 200 steps), validation still only at the end.
    ckpt_overrides = base + [f"train.eval_every={STEPS}"]
    tag = "loaded" if load else "idle"
    bare: list[float] = []
    bare_same: list[float] = []
    quiet: list[dict[str, Any]] = []
    ckpt: list[dict[str, Any]] = []
    bare_twice: list[float] = []  # the same bare loop twice in a round: the measurement's own noise
    with outside_load(load):
        # A discarded first project run: it learns the thread count the policy picks here, and
        # takes the first run's page-cache and allocator warm-up out of the rounds.
        _project_loop(work, f"warmup-{tag}", quiet_overrides)
        threads = torch.get_num_threads()

        def bare_at(n: int) -> float:
            torch.set_num_threads(n)
            return _bare_loop(load_config(overrides=base), job.dataset_dir, job.stats_path)

        for r in range(rounds):
            # The project loop is bracketed by two bare loops on its threads, and its reference
            # is their mean: a shared box drifts by 10-30 % within a minute, and bracketing
            # cancels a linear drift. The other loops alternate ends between rounds, so no loop
            # always runs first or last. Each figure is a median over rounds of a ratio taken
            # within one round.
            ends = ["bare", "ckpt"] if r % 2 == 0 else ["ckpt", "bare"]
            _run_end(ends[0], work, f"{tag}{r}", ckpt_overrides, bare, ckpt, bare_at)
            before = bare_at(threads)
            quiet.append(_project_loop(work, f"quiet-{tag}{r}", quiet_overrides))
            after = bare_at(threads)
            bare_same.append((before + after) / 2)
            bare_twice.append(after / before - 1)
            _run_end(ends[1], work, f"{tag}{r}", ckpt_overrides, bare, ckpt, bare_at)
    loop = [q["seconds"] / b - 1 for q, b in zip(quiet, bare, strict=True)]
    same = [q["seconds"] / b - 1 for q, b in zip(quiet, bare_same, strict=True)]
    checkpointing = [c["seconds"] / q["seconds"] - 1 for c, q in zip(ckpt, quiet, strict=True)]
    return {
        f"bare_loop_seconds_torch_default_threads_{tag}": [round(b, 3) for b in bare],
        f"bare_loop_seconds_same_threads_{tag}": [round(b, 3) for b in bare_same],
        f"project_loop_seconds_no_eval_no_checkpoints_{tag}": [round(q["seconds"], 3) for q in quiet],
        f"project_threads_{tag}": threads,
        # Cores other processes kept busy while each bracketed project loop set up: the burner is
        # 1.0; more is other work on the machine during that round.
        f"others_busy_per_round_{tag}": [q["others_busy"] for q in quiet],
        f"loop_overhead_fraction_per_round_{tag}": [round(x, 3) for x in loop],
        f"loop_overhead_fraction_{tag}": round(statistics.median(loop), 3),
        f"loop_overhead_fraction_same_threads_per_round_{tag}": [round(x, 3) for x in same],
        f"loop_overhead_fraction_same_threads_{tag}": round(statistics.median(same), 3),
        f"bare_loop_again_fraction_per_round_{tag}": [round(x, 3) for x in bare_twice],
        f"bare_loop_again_spread_{tag}": round(statistics.median(abs(x) for x in bare_twice), 3),
        f"project_loop_seconds_checkpoint_every_200_{tag}": [round(c["seconds"], 3) for c in ckpt],
        f"checkpointing_overhead_fraction_per_round_{tag}": [round(x, 3) for x in checkpointing],
        f"checkpointing_overhead_fraction_{tag}": round(statistics.median(checkpointing), 3),
    }


# A model whose math is a small part of a step: what is left of the project's step beyond the
# bare loop's is the loop's own per-step work (its bookkeeping and its loader), in microseconds.
_TINY_MODEL = ["model.hidden=[4]", "model.embedding_dim=1"]


def _per_step_work(work: Path, base: list[str], rounds: int) -> dict[str, Any]:
    """The project's per-step work beyond the bare loop's, idle, on a tiny model at the same
    threads: the floor under the loop overhead, whatever the model."""
    tiny = base + _TINY_MODEL
    quiet = tiny + [f"train.eval_every={STEPS}", f"train.checkpoint.every={STEPS}"]
    job = train_job(work, "tiny-probe", tiny)
    _project_loop(work, "tiny-warmup", quiet)
    threads = torch.get_num_threads()
    bare, project = [], []
    for r in range(rounds):
        torch.set_num_threads(threads)
        if r % 2:
            project.append(_project_loop(work, f"tiny-{r}", quiet)["seconds"])
        torch.set_num_threads(threads)
        bare.append(_bare_loop(load_config(overrides=tiny), job.dataset_dir, job.stats_path))
        if not r % 2:
            torch.set_num_threads(threads)
            project.append(_project_loop(work, f"tiny-{r}", quiet)["seconds"])
    extra = [(p - b) / STEPS * 1e6 for p, b in zip(project, bare, strict=True)]
    return {"tiny_model_bare_step_us": round(statistics.median(bare) / STEPS * 1e6, 1),
            "tiny_model_project_step_us": round(statistics.median(project) / STEPS * 1e6, 1),
            "per_step_work_beyond_bare_us_per_round": [round(x, 1) for x in extra],
            "per_step_work_beyond_bare_us": round(statistics.median(extra), 1)}


# The loop's host work per step, by how many steps a block holds: one (every step pays the
# timing, heartbeat, budget and stop decisions), fifty (they run once per fifty steps), and fifty
# with the capturable step (train.step graph: on a CPU it runs as it is, no CUDA graph).
_BLOCKS = {"eager_1_step_blocks": ["train.steps_per_block=1", "train.step=eager"],
           "eager_50_step_blocks": ["train.steps_per_block=50", "train.step=eager"],
           "capturable_50_step_blocks": ["train.steps_per_block=50", "train.step=graph"]}


def _block_host_time(work: Path, base: list[str], rounds: int) -> dict[str, Any]:
    """Per-step time of the tiny model's loop (so what is measured is mostly the loop's own
    host work), by block length, in one run: the contestants' order rotates each round, and
    each figure is the loop's time on one clock (its train, validation and checkpoint
    seconds), the same for every side."""
    tiny = base + _TINY_MODEL + [f"train.eval_every={STEPS}", f"train.checkpoint.every={STEPS}"]
    names = list(_BLOCKS)
    for name in names:
        _project_loop(work, f"blocks-warmup-{name}", tiny + _BLOCKS[name])
    per_step: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            seconds = _project_loop(work, f"blocks-{name}-{r}", tiny + _BLOCKS[name])["seconds"]
            per_step[name].append(seconds / STEPS * 1e6)
    out: dict[str, Any] = {f"tiny_model_step_us_{n}_per_round": [round(x, 1) for x in v] for n, v in per_step.items()}
    out.update({f"tiny_model_step_us_{n}": round(statistics.median(v), 1) for n, v in per_step.items()})
    ratios = [b / a for a, b in zip(per_step["eager_1_step_blocks"], per_step["eager_50_step_blocks"], strict=True)]
    out["fifty_step_blocks_over_one_step_blocks_per_round"] = [round(x, 3) for x in ratios]
    out["fifty_step_blocks_over_one_step_blocks"] = round(statistics.median(ratios), 3)
    return out


def run(work: Path, rounds: int = 9) -> dict[str, Any]:
    """The loop overhead at default settings, on an idle machine and beside a CPU burner; the
    bare loop runs with torch's default thread count (as a hand-written loop would) and with the
    project's (the same math on the same threads, bracketing the project's loop). Nine rounds:
    on this 2-core machine one round in five lands 20-60 % off in either condition, and the
    median of five moved from 0.10 to 0.19 between runs of the same code."""
    source = demo_parquet(work, 200_000)
    # Several train shards: the loader's reads after start-up are part of the timed loop.
    base = [f"data.source={source}", f"train.max_steps={STEPS}", "train.patience=0", "data.shard_size_mb=2"]
    job = train_job(work, "probe", base)
    out: dict[str, Any] = {"steps": STEPS, "rounds": rounds, "torch_default_threads": DEFAULT_THREADS}
    out.update(_loop_rounds(work, job, base, rounds, load=False))
    out.update(_loop_rounds(work, job, base, rounds, load=True))
    out.update(_per_step_work(work, base, rounds))
    out.update(_block_host_time(work, base, rounds))
    # That work as a share of a default-model step at the project's threads, idle and loaded.
    for tag in ("idle", "loaded"):
        step_us = statistics.median(out[f"bare_loop_seconds_same_threads_{tag}"]) / STEPS * 1e6
        out[f"default_model_bare_step_us_{tag}"] = round(step_us, 1)
        out[f"per_step_work_share_of_a_step_{tag}"] = round(out["per_step_work_beyond_bare_us"] / step_us, 3)
    torch.set_num_threads(DEFAULT_THREADS)
    out.update(_prefect_overhead(work, source, rounds))
    return out
