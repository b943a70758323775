"""The training loop: one function that reads top to bottom.

Everything that shapes the future of the run is in the checkpoint (model, optimizer, scheduler,
scaler, step, data position, every RNG, early-stopping state, time accumulators, history), so a
run killed at any moment and resumed ends bit-identical to an uninterrupted one (deterministic
mode, same hardware). Rank-aware through `rank`/`world_size` arguments and free of module state,
so it can run under torchrun later.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

from training.checkpoint import (
    AsyncCheckpointer,
    CheckpointManifest,
    latest_verified_state,
    load_checkpoint_state,
    step_dir_name,
)
from training.config import RetrainConfig
from training.data.features import FeatureStats
from training.data.loader import ShardBatches, StreamPosition, make_train_loader
from training.data.packing import load_manifest
from training.early_stopping import EarlyStopping
from training.checkpoint_upload import CheckpointUploader, restore_newer_checkpoint
from training.errors import CheckpointError, DataError, Preempted, RetrainError
from training.evaluate import meta_sha256, predict_split
from training.heartbeat import Heartbeat, RemoteHeartbeat
from training.attempts import append_attempt, read_attempts
from training.job import TrainJob, train_fingerprint
from training.metrics import log_loss, roc_auc
from training.model import build_model, weights_sha256
from training.precision import autocast_dtype, resolve_device, resolve_precision
from training.rng import capture_rng, configure_determinism, restore_rng, seed_everything
from training.storage import read_json, write_json_atomic
from training.storage_root import MODEL, RUN, StorageRoot
from training.throughput import choose_num_workers, find_micro_batch

__all__ = ["StopFlag", "train", "EVAL_BATCH_SIZE"]

log = logging.getLogger(__name__)
EVAL_BATCH_SIZE = 8192
_STATUSES = ("completed", "budget_stopped", "early_stopped")
_STATUS_CODES = {name: i for i, name in enumerate(_STATUSES)}


class StopFlag:
    """Set from a signal handler or the spot-notice poller; checked after each optimizer step."""

    def __init__(self) -> None:
        self.reason: str | None = None

    def request(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    @property
    def requested(self) -> bool:
        return self.reason is not None


@dataclass
class RunState:
    """Counters that survive resumes (saved in every checkpoint)."""

    step: int = 0
    epoch: int = 0
    batch: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    resumed_from_steps: list[int] = field(default_factory=list)
    preemptions: int = 0
    steps_lost: int = 0
    seconds: dict[str, float] = field(
        default_factory=lambda: {"train": 0.0, "data_wait": 0.0, "compute": 0.0, "checkpoint": 0.0, "eval": 0.0,
                                 "lost": 0.0, "startup": 0.0, "pre_train": 0.0}
    )
    checkpoints_saved: int = 0
    last_save_train_seconds: float = 0.0
    save_cost_seconds: float | None = None  # moving average of measured save cost
    restart_to_first_step_seconds: list[float] = field(default_factory=list)
    stop_reason: str | None = None
    # The micro-batch layout is decided once, at the run's first start, and kept across
    # resumes: the data position counts global micro-batches of this size.
    micro_batch: int | None = None  # rows per global micro-batch (all processes)
    grad_accum: int | None = None
    auto_batch: dict[str, Any] | None = None
    num_workers: int | None = None  # what num_workers="auto" chose at the first start

    def billed_seconds(self) -> float:
        """Every second the machine was held for this run, lost work and restarts included."""
        s = self.seconds
        return s["pre_train"] + s["startup"] + s["train"] + s["eval"] + s["checkpoint"] + s["lost"]


class CheckpointSchedule:
    """When to checkpoint: every N steps, every S seconds of training, or the Young/Daly
    optimum sqrt(2 * save cost * mean time between preemptions) from the measured save cost."""

    def __init__(self, mode: str, value: float, mean_seconds_between_preemptions: float) -> None:
        self.mode, self.value, self.mtbp = mode, value, mean_seconds_between_preemptions

    def interval_seconds(self, state: RunState) -> float | None:
        if self.mode == "seconds":
            return self.value
        if self.mode == "auto" and state.save_cost_seconds is not None:
            return math.sqrt(2.0 * state.save_cost_seconds * self.mtbp)
        return None

    def due(self, state: RunState) -> bool:
        if self.mode == "steps":
            return state.step % int(self.value) == 0
        interval = self.interval_seconds(state)
        return interval is not None and state.seconds["train"] - state.last_save_train_seconds >= interval

    def describe(self, state: RunState) -> dict[str, Any]:
        return {"mode": self.mode, "steps": int(self.value) if self.mode == "steps" else None,
                "seconds": self.interval_seconds(state), "save_cost_seconds": state.save_cost_seconds,
                "mean_seconds_between_preemptions": self.mtbp if self.mode == "auto" else None}


class Budget:
    """The run's spending limits in seconds, dollars and GPU-hours of held machine time."""

    def __init__(self, config: Any, rate_per_hour: float, gpus: int) -> None:
        self.config, self.rate, self.gpus = config, rate_per_hour, gpus
        self.active = any(v is not None for v in (config.max_wall_seconds, config.max_usd, config.max_gpu_hours))

    def exceeded(self, state: RunState, next_steps: int) -> str | None:
        if not self.active:
            return None  # checked every step: no work when there is nothing to check
        spent = state.billed_seconds()
        per_step = (state.seconds["train"] + state.seconds["checkpoint"]) / max(1, state.step)
        per_eval = state.seconds["eval"] / max(1, len(state.history))
        projected = spent + (per_step * next_steps + per_eval if next_steps else 0.0)
        c = self.config
        checks = [
            ("budget.max_wall_seconds", c.max_wall_seconds, spent, projected, 1.0, "s"),
            ("budget.max_usd", c.max_usd, spent, projected, self.rate / 3600.0, "$"),
            ("budget.max_gpu_hours", c.max_gpu_hours, spent, projected, self.gpus / 3600.0, "GPU-h"),
        ]
        for key, limit, now, then, per_second, unit in checks:
            if limit is None or per_second == 0:
                continue
            if then * per_second > limit:
                return (f"{key}={limit:g}: {now * per_second:.4g} {unit} spent, "
                        f"{then * per_second:.4g} {unit} after the next interval")
        return None


def champion_gate(history: list[dict[str, Any]], champion_auc: float | None, min_delta: float, max_steps: int) -> str | None:
    """Stop when even an optimistic linear extrapolation of the last three validations cannot
    reach the champion's validation AUC plus min_delta by max_steps."""
    if champion_auc is None or len(history) < 3:
        return None
    recent = history[-3:]
    steps = np.array([h["step"] for h in recent], dtype=np.float64)
    aucs = np.array([h["val_auc"] for h in recent], dtype=np.float64)
    slope = float(np.polyfit(steps, aucs, 1)[0])
    best = max(h["val_auc"] for h in history)
    reachable = best + max(0.0, slope) * (max_steps - steps[-1])
    needed = champion_auc + min_delta
    if reachable < needed:
        return (f"champion gate: validation AUC trend reaches at most {reachable:.4f} by step {max_steps}, "
                f"the champion needs {needed:.4f}")
    return None


def measure_fp32_slowdown(model: torch.nn.Module, batches: ShardBatches, device: torch.device, precision: str,
                          steps: int = 10) -> float:
    """fp32 step time over this run's precision, timed on a copy of the model (for the naive
    counterfactual in the cost report)."""
    import copy

    def timed(dtype: torch.dtype | None) -> float:
        m = copy.deepcopy(model).train()
        x_num, x_cat, y = (t.to(device) for t in batches.batch(0, 0))
        for i in range(steps + 3):  # 3 warm-up steps
            if i == 3:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                out = m(x_num, x_cat)
            F.binary_cross_entropy_with_logits(out.float(), y).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    return timed(None) / timed(autocast_dtype(precision))


def accelerator_stats(device: torch.device) -> dict[str, Any]:
    """Memory and utilisation on CUDA; "n/a" elsewhere, never invented."""
    if device.type != "cuda":
        return {"memory_peak_bytes": "n/a", "memory_total_bytes": "n/a", "memory_peak_fraction": "n/a",
                "utilization_percent": "n/a"}
    peak = torch.cuda.max_memory_allocated(device)
    total = torch.cuda.get_device_properties(device).total_memory
    try:
        util: Any = torch.cuda.utilization(device)  # NVML, when pynvml is installed
    except Exception:  # noqa: BLE001 - NVML missing or unsupported
        util = "n/a"
    return {"memory_peak_bytes": peak, "memory_total_bytes": total, "memory_peak_fraction": peak / total,
            "utilization_percent": util, "memory_stats": {k: v for k, v in torch.cuda.memory_stats(device).items()
                                                          if k in ("num_alloc_retries", "num_ooms")}}


def _warm_start(model: torch.nn.Module, weights: Path, sha256: str | None) -> None:
    try:
        state = torch.load(weights, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001
        raise CheckpointError(f"warm start: cannot load {weights} ({err})") from None
    if sha256 is not None and weights_sha256(state) != sha256:
        raise CheckpointError(f"warm start: {weights} does not match the champion's sha256 (corrupted)")
    model.load_state_dict(state)
    log.info("warm start from %s", weights)


def _shutdown_workers(batches: Any) -> None:
    # The train stream is endless, so its worker processes are still prefetching when the
    # loop ends; stop them now rather than at garbage collection.
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def _lr_lambda(warmup: int, total: int) -> Callable[[int], float]:
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))  # cosine down to 10%

    return f


def evaluate_batches(model: torch.nn.Module, batches: ShardBatches, device: torch.device, precision: str) -> dict[str, float]:
    p, y = predict_split(model, batches, device, autocast_dtype(precision))
    return {"auc": roc_auc(y, p), "logloss": log_loss(y, p)}


def train(
    job: TrainJob,
    stop: StopFlag | None = None,
    emit: Callable[[dict[str, Any]], None] = lambda event: None,
    rank: int = 0,
    world_size: int = 1,
    now_fn: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """Train (or resume, or find already finished) the run in `job.run_dir`; return its result."""
    stop = stop or StopFlag()
    emit_any_rank = emit
    if rank != 0:
        emit = lambda event: None  # noqa: E731 - progress is rank 0's to report
    started = time.time()
    spawn_time = float(os.environ.get("RETRAIN_SPAWN_TIME", started))
    config = job.config
    tc = config.train
    run_dir = Path(job.run_dir)
    ckpt_dir = run_dir / "checkpoints"
    result_path = run_dir / "result.json"

    root = StorageRoot.from_config(config) if config.storage.is_s3 and job.run_rel else None
    if root is not None:
        root.fetch_finished_run(job.run_rel)
    finished = read_json(result_path)
    if finished is not None:
        finished["already_complete"] = True
        return finished

    device = resolve_device(tc.device)
    precision = resolve_precision(tc.precision, device)
    config_fp = train_fingerprint(config, device.type, precision)
    seed_everything(tc.seed)
    configure_determinism(tc.deterministic, device)

    dataset_dir = Path(job.dataset_dir)
    manifest = load_manifest(dataset_dir)
    if manifest is None:
        raise DataError(f"dataset {dataset_dir} is incomplete (no manifest.json); rerun the pack stage")
    stats = FeatureStats.from_json(Path(job.stats_path).read_text())
    transform = stats.transformer()
    val_batches = ShardBatches(
        dataset_dir, manifest, "validation", EVAL_BATCH_SIZE, transform, shuffle=False, drop_last=False
    )

    model = build_model(config.model, len(stats.numeric), stats.cardinalities).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=tc.peak_lr(), weight_decay=tc.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(tc.warmup_steps, tc.max_steps))
    # bf16 needs no GradScaler: it has fp32's exponent range. Only fp16 can underflow.
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    stopper = EarlyStopping(tc.patience, tc.min_delta)
    state = RunState()
    run_dir.mkdir(parents=True, exist_ok=True)
    remote_beat = None
    if root is not None and rank == 0:
        remote_beat = RemoteHeartbeat(root, job.run_rel, job.run_key, config.storage.heartbeat_seconds)
    heartbeat = Heartbeat(run_dir / ("heartbeat.bin" if rank == 0 else f"heartbeat-rank{rank}.bin"), remote_beat)
    uploader = None
    if root is not None:
        # A fresh machine: the ledger and the newest complete checkpoint come from S3, fetched
        # by one process per node (they share its disk) while the node's other ranks wait.
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            root.fetch(f"{job.run_rel}/attempts.jsonl")
            restore_newer_checkpoint(root, f"{job.run_rel}/checkpoints", ckpt_dir)
        if world_size > 1:
            dist.barrier()
        if rank == 0:
            uploader = CheckpointUploader(root, job.run_rel, job.run_key, tc.keep_last)
    attempts = read_attempts(run_dir)

    found = latest_verified_state(ckpt_dir)
    resumed_step: int | None = None
    steps_lost, seconds_lost = 0, 0.0
    if found is not None:
        path, ckpt_manifest, saved = found
        if ckpt_manifest.run_key != job.run_key or ckpt_manifest.config_fingerprint != config_fp:
            raise CheckpointError(
                f"checkpoint {path} belongs to run {ckpt_manifest.run_key} (config {ckpt_manifest.config_fingerprint}), "
                f"not {job.run_key} (config {config_fp}); move it away or use a fresh storage.root"
            )
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        scaler.load_state_dict(saved["scaler"])
        stopper.load_state_dict(saved["early_stopping"])
        state = RunState(**saved["run"])
        for key, value in RunState().seconds.items():
            state.seconds.setdefault(key, value)
        per_rank = saved.get("rng_per_rank")
        # Each rank its own generators when the world size is unchanged; else rank 0's for all.
        restore_rng(per_rank[rank] if per_rank is not None and len(per_rank) == world_size else saved["rng"])
        resumed_step = state.step
        beat = heartbeat.read()
        if beat is not None and beat.step > state.step:
            steps_lost, seconds_lost = beat.step - state.step, max(0.0, beat.train_seconds - state.seconds["train"])
        log.info("resuming from %s (step %d)", path.name, state.step)
        emit({"event": "resumed", "step": state.step, "checkpoint": str(path)})
    else:
        if ckpt_dir.exists() and any(ckpt_dir.iterdir()):
            log.warning("no verified checkpoint in %s: starting from step 0", ckpt_dir)
        if job.init_weights is not None:
            _warm_start(model, Path(job.init_weights), job.init_sha256)
        beat = heartbeat.read()
        if beat is not None and beat.step > 0:
            # An earlier attempt died before its first checkpoint: all of it was lost.
            resumed_step, steps_lost, seconds_lost = 0, beat.step, beat.train_seconds
    heartbeat.start(state.step, state.seconds["train"])
    # The preemption accounting goes to a durable per-run ledger now, not only into the next
    # checkpoint: an attempt that dies before its first checkpoint must not take its record along.
    entry: dict[str, Any] = {"resumed_from": resumed_step, "steps_lost": steps_lost, "seconds_lost": seconds_lost,
             "startup_seconds": time.time() - spawn_time}
    entries = append_attempt(run_dir / "attempts.jsonl", entry) if rank == 0 else [entry]
    state.resumed_from_steps = [e["resumed_from"] for e in entries if e["resumed_from"] is not None]
    state.steps_lost = sum(e["steps_lost"] for e in entries)
    state.seconds["lost"] = sum(e["seconds_lost"] for e in entries)
    state.seconds["startup"] = sum(e["startup_seconds"] for e in entries)
    # An attempt killed before it got this far leaves only the launcher's count.
    state.preemptions = max(len(entries) - 1, attempts - 1)

    checkpointer = AsyncCheckpointer(ckpt_dir, tc.keep_last, on_published=uploader.submit if uploader else None,
                                     in_use=uploader.in_flight if uploader else set)
    if uploader is not None and found is not None:
        # Resumed from a local checkpoint S3 may lack (its upload was cut off): make it durable.
        remote_steps = root.remote_checkpoints(f"{job.run_rel}/checkpoints") if root else {}
        if "manifest.json" not in remote_steps.get(resumed_step or 0, {}):
            uploader.submit(found[0], {resumed_step or 0})

    def save(emergency: bool = False) -> None:
        """Called on every rank at the same step (the RNG gather is a collective); rank 0 writes."""
        t0 = now_fn()
        rng = capture_rng()
        rng_per_rank = None
        if world_size > 1:
            rng_per_rank = [None] * world_size
            dist.all_gather_object(rng_per_rank, rng)
        if rank != 0:
            return
        # Accounting first, so the saved state already counts this save.
        state.checkpoints_saved += 1
        state.last_save_train_seconds = state.seconds["train"]
        payload: dict[str, Any] = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "early_stopping": stopper.state_dict(),
            "run": asdict(state),
            "rng": rng,
        }
        if rng_per_rank is not None:
            payload["rng_per_rank"] = rng_per_rank
        val_auc = state.history[-1]["val_auc"] if state.history and state.history[-1]["step"] == state.step else None
        man = CheckpointManifest(state.step, job.run_key, config_fp, {}, val_auc=val_auc, emergency=emergency,
                                 extra={"tags": dict(config.cost.tags)})
        protect = {s for s in (stopper.best_step, resumed_step) if s is not None}
        # Emergency saves block: the process exits right after. Others write in the background
        # and the loop only waits for the in-memory copy.
        checkpointer.save(man, payload, protect, blocking=emergency)
        stall = now_fn() - t0
        state.seconds["checkpoint"] += stall
        state.save_cost_seconds = stall if state.save_cost_seconds is None else 0.7 * state.save_cost_seconds + 0.3 * stall
        emit({"event": "checkpoint", "step": state.step, "emergency": emergency})

    schedule = CheckpointSchedule(*tc.checkpoint_interval(), tc.mean_seconds_between_preemptions)
    dtype = autocast_dtype(precision)
    if state.micro_batch is None:
        state.micro_batch, state.grad_accum = tc.batch_size, tc.grad_accum
        train_rows = sum(s.rows for s in manifest.shards_of("train"))
        if train_rows < state.micro_batch:
            # Small data trains with the defaults, as in peers: one batch is the whole split. Kept
            # in the checkpoint like every layout decision, so a resume batches identically.
            state.micro_batch = max(world_size, train_rows // world_size * world_size)
            log.warning("the train split has %d rows, fewer than train.batch_size %d: training with batches of "
                        "%d rows (the whole split)", train_rows, tc.batch_size, state.micro_batch)
        if tc.auto_batch_size:
            state.micro_batch, state.grad_accum, state.auto_batch = _auto_batch(
                model, tc, len(stats.numeric), len(stats.categorical), device, dtype, rank, world_size)
    grad_accum = int(state.grad_accum or tc.grad_accum)
    # The global micro-batch is split across the processes: each takes its share.
    # The node's ranks each hold their own shards: they share the node's loader memory.
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    train_batches = ShardBatches(dataset_dir, manifest, "train", state.micro_batch // world_size, transform, seed=tc.seed,
                                 cache_bytes=int(tc.loader_cache_mb * 1e6) // local_world)
    workers_probe = None
    num_workers = tc.num_workers
    if num_workers == "auto" and state.num_workers is not None:
        num_workers = state.num_workers  # probed at the first start: a restart does not pay for it again
    elif num_workers == "auto":
        workers_probe = choose_num_workers(
            model, lambda i: train_batches.batch(0, i % train_batches.batches_per_epoch), device, dtype)
        num_workers = state.num_workers = workers_probe["num_workers"]
        if num_workers:
            train_batches.release()  # workers get a copy of this object: without the probe's shards
    loader = make_train_loader(
        train_batches, StreamPosition(state.epoch, state.batch), int(num_workers), pin_memory=device.type == "cuda",
        rank=rank, world=world_size,
    )
    compile_seconds = None
    if tc.compile:
        t_compile = time.perf_counter()
        compiled = torch.compile(model)
        with torch.no_grad(), torch.random.fork_rng():  # compile now: the warm-up stays out of the step timings
            x_num, x_cat, _ = train_batches.batch(0, 0)
            compiled(x_num[:2].to(device), x_cat[:2].to(device))
        if num_workers:
            train_batches.release()
        compile_seconds = time.perf_counter() - t_compile
    else:
        compiled = model
    source: Any = loader.dataset if isinstance(loader, DataLoader) else loader
    per_epoch = source.per_epoch  # global batches per epoch
    ddp = None
    if world_size > 1:
        # After the resume: every rank loaded the same checkpoint, and DDP checks it by
        # broadcasting rank 0's parameters. Gradients are averaged in buckets during backward.
        ddp = torch.nn.parallel.DistributedDataParallel(compiled, bucket_cap_mb=tc.ddp_bucket_mb)
    forward = ddp if ddp is not None else compiled
    stop_agreed = False
    rows_seen = 0
    on_accelerator = device.type != "cpu"
    batches = iter(loader)
    model.train()
    status = "completed"
    first_step_latency: float | None = None
    if resumed_step is None:
        state.seconds["pre_train"] = job.pre_train_seconds  # once per run, not per attempt
    budget = Budget(config.budget, job.rate_per_hour, job.gpus)
    profiler = None
    if tc.profile:
        from training.profiling import StepProfiler

        profiler = StepProfiler(run_dir / "profile", device)
    def validate(train_loss: float) -> bool:
        """Validation AUC at this step; True when it is a new best."""
        t_eval = now_fn()
        val = evaluate_batches(model, val_batches, device, precision)
        better = stopper.update(val["auc"], state.step)
        state.history.append(
            {"step": state.step, "train_loss": train_loss, "val_auc": val["auc"], "val_logloss": val["logloss"],
             "lr": float(scheduler.get_last_lr()[0])}
        )
        state.seconds["eval"] += now_fn() - t_eval
        emit({"event": "validation", **state.history[-1], "max_steps": tc.max_steps,
              "spent_seconds": state.billed_seconds()})
        return better

    last = now_fn()
    while state.step < tc.max_steps:
        # One process decides alone; under DDP every rank acts on the flag they agreed on at
        # the end of the last step, so all of them stop at the same step.
        if stop_agreed if world_size > 1 else stop.requested:
            save(emergency=True)
            if uploader is not None:
                # The local disk of a spot machine dies with it: the emergency checkpoint counts
                # only once it is on S3.
                try:
                    uploader.flush()
                except RetrainError as err:
                    log.error("emergency checkpoint stayed local: %s", err)
            heartbeat.close()
            _shutdown_workers(batches)
            if world_size > 1:
                dist.barrier()  # nobody exits (and makes torchrun kill the rest) before rank 0 wrote
            raise Preempted(f"stopped at step {state.step}: {stop.reason or 'another rank was stopped'}",
                            step=state.step)
        if checkpointer.failed:
            checkpointer.wait()  # raises the save's error: steps past a failed save would be lost work
        optimizer.zero_grad(set_to_none=True)
        loss_sum: torch.Tensor | None = None
        for micro in range(grad_accum):
            t_wait = now_fn()
            epoch, index, x_num, x_cat, y = next(batches)
            if on_accelerator:
                x_num, x_cat, y = x_num.to(device, non_blocking=True), x_cat.to(device, non_blocking=True), y.to(device)
            t_compute = now_fn()
            state.seconds["data_wait"] += t_compute - t_wait
            rows_seen += int(y.shape[0])
            # Under DDP only the last micro-batch all-reduces: the others accumulate locally.
            sync = ddp.no_sync() if ddp is not None and micro < grad_accum - 1 else contextlib.nullcontext()
            with sync:
                if dtype is None:
                    logits = forward(x_num, x_cat)  # fp32: no autocast context to enter every step
                else:
                    with torch.autocast(device.type, dtype=dtype):
                        logits = forward(x_num, x_cat)
                # Loss in fp32 and divided by the accumulation steps, so the summed gradient is a mean.
                loss = F.binary_cross_entropy_with_logits(logits.float(), y)
                if grad_accum > 1:
                    loss = loss / grad_accum
                scaler.scale(loss).backward()
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
            state.seconds["compute"] += now_fn() - t_compute
        assert loss_sum is not None  # grad_accum >= 1: at least one micro-batch ran
        state.epoch, state.batch = divmod(epoch * per_epoch + index + 1, per_epoch)
        if tc.grad_clip > 0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        state.step += 1
        now = now_fn()
        state.seconds["train"] += now - last
        last = now
        heartbeat.write(state.step, state.seconds["train"])
        if profiler is not None:
            profiler.step()
        if first_step_latency is None:
            first_step_latency = time.time() - spawn_time
            if resumed_step is not None:
                state.restart_to_first_step_seconds.append(first_step_latency)

        improved = False
        validated = state.step % tc.eval_every == 0 or state.step == tc.max_steps
        if validated and world_size > 1:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)  # the global batch's loss, as with one process
        if validated and rank == 0:
            improved = validate(float(loss_sum))
        # Budgets: at a validation, stop if the next interval would cross a limit; at any step,
        # stop once a limit is crossed (a step far slower than the average so far).
        over = budget.exceeded(state, tc.eval_every if validated else 0) if rank == 0 else None
        if over is not None:
            if not validated:
                improved = validate(float(loss_sum))  # the best model must be validated before we stop
            status, state.stop_reason = "budget_stopped", over
        elif validated and rank == 0 and stopper.should_stop:
            status = "early_stopped"
            state.stop_reason = f"no validation AUC gain > {tc.min_delta} in {tc.patience} validations"
        elif validated and rank == 0 and config.budget.champion_gate:
            gated = champion_gate(state.history, job.champion_val_auc, config.eval.min_delta, tc.max_steps)
            if gated is not None:
                status, state.stop_reason = "early_stopped", gated
        save_now = schedule.due(state) or improved or status != "completed" or state.step == tc.max_steps
        if world_size > 1:
            # Rank 0 decided (validation, budgets and time-based schedules are its alone); every
            # rank contributes its stop request. One tiny all-reduce per step keeps them in step.
            flags = torch.tensor([int(stop.requested), _STATUS_CODES[status] if rank == 0 else 0,
                                  int(save_now) if rank == 0 else 0], dtype=torch.int64)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            stop_agreed = bool(flags[0])
            status = _STATUSES[int(flags[1])]
            save_now = bool(flags[2])
        if save_now:
            save()
        last = now_fn()  # checkpoint and eval time are accounted separately
        if status != "completed":
            log.info("stopping at step %d: %s", state.step, state.stop_reason)
            break
    heartbeat.close()
    _shutdown_workers(batches)
    emit_any_rank({"event": "rank_done", "rank": rank, "rows": rows_seen, "step": state.step})
    if rank != 0:
        return {"rank": rank, "rows": rows_seen, "steps": state.step, "status": status}
    if profiler is not None:
        profiler.close()
    checkpointer.wait()  # the final and best checkpoints must be on disk before export
    if uploader is not None:
        uploader.flush()
        uploader.close()

    fp32_slowdown = 1.0 if precision == "fp32" else measure_fp32_slowdown(model, train_batches, device, precision)

    best_step = stopper.best_step
    assert best_step is not None  # every run validates at least once: at its last step
    best_dir = ckpt_dir / step_dir_name(best_step)
    best_state = load_checkpoint_state(best_dir)["model"]
    package = export_model_package(run_dir / "model", best_state, config, stats, job.run_key, best_step, stopper.best)
    result = {
        "run_key": job.run_key,
        "status": status,
        "stop_reason": state.stop_reason,
        "fp32_slowdown": fp32_slowdown,
        "profile": profiler.summary() if profiler is not None else None,
        "max_steps": tc.max_steps,
        "billed_seconds": state.billed_seconds(),
        "accelerator": accelerator_stats(device),
        "steps": state.step,
        "best_step": best_step,
        "best_val_auc": stopper.best,
        "precision": precision,
        "device": device.type,
        "model": package,
        "history": state.history,
        "resumed_from_steps": state.resumed_from_steps,
        "preemptions": state.preemptions,
        "steps_lost": state.steps_lost,
        "seconds": state.seconds,
        "first_step_latency_seconds": first_step_latency,
        "restart_to_first_step_seconds": state.restart_to_first_step_seconds,
        "checkpoints_saved": state.checkpoints_saved,
        "checkpoint_background_seconds": checkpointer.background_seconds,
        "checkpoint_interval": schedule.describe(state),
        "samples_seen": state.step * state.micro_batch * grad_accum,  # the micro-batch is already global
        "batch_layout": {"micro_batch": state.micro_batch, "grad_accum": grad_accum, "auto": state.auto_batch,
                         "peak_lr": tc.peak_lr()},
        "num_workers": {"used": int(num_workers), "probe": workers_probe},
        "compile_seconds": compile_seconds,
        "world_size": world_size,
    }
    if uploader is not None:
        result["checkpoint_upload"] = {"uploaded": len(uploader.uploaded), "superseded": uploader.superseded,
                                       "failures": uploader.failures, "background_seconds": uploader.seconds}
    if rank == 0:
        write_json_atomic(result_path, result)
        if root is not None:
            root.publish_all([f"{job.run_rel}/model/model.pt", f"{job.run_rel}/model/model.json"], MODEL, job.run_key)
            root.publish(f"{job.run_rel}/attempts.jsonl", RUN, job.run_key)
            root.publish(f"{job.run_rel}/result.json", RUN, job.run_key)  # last: the run is done
    return result


def _auto_batch(model: torch.nn.Module, tc: Any, n_num: int, n_cat: int, device: torch.device,
                dtype: torch.dtype | None, rank: int, world_size: int) -> tuple[int, int, dict[str, Any] | None]:
    """(global micro-batch, grad_accum, search record) from the memory search on this device."""
    if device.type == "cuda":
        budget = int(torch.cuda.get_device_properties(device).total_memory * tc.memory_fraction)
    elif tc.simulated_memory_mb is not None:
        budget = int(tc.simulated_memory_mb * (1 << 20) * tc.memory_fraction)
    else:
        log.info("auto_batch_size: no accelerator memory to fit on %s; keeping train.batch_size", device.type)
        return tc.batch_size, tc.grad_accum, {"skipped": f"no accelerator memory on {device.type}"}
    per_rank = tc.batch_size // world_size * tc.grad_accum
    search = find_micro_batch(model, per_rank, n_num, n_cat, device, dtype, budget)
    layout = [search.micro_batch, search.grad_accum]
    if world_size > 1:
        dist.broadcast_object_list(layout, src=0)  # every rank uses rank 0's choice
    record = {"micro_batch_per_process": layout[0], "grad_accum": layout[1], "max_fitting": search.max_fitting,
              "budget_bytes": search.budget_bytes, "probes": search.probes, "seconds": search.seconds}
    log.info("auto_batch_size: micro-batch %d x %d accumulation per process (largest fitting: %d rows)",
             layout[0], layout[1], search.max_fitting)
    return layout[0] * world_size, layout[1], record


def export_model_package(
    out_dir: Path,
    state_dict: dict[str, torch.Tensor],
    config: RetrainConfig,
    stats: FeatureStats,
    run_key: str,
    best_step: int | None,
    val_auc: float | None,
) -> dict[str, Any]:
    """A self-contained model: weights plus everything needed to score new data."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sha = weights_sha256(state_dict)
    tmp = out_dir / f".model.pt.tmp-{os.getpid()}"
    torch.save(state_dict, tmp)
    os.replace(tmp, out_dir / "model.pt")
    meta = {
        "sha256": sha,
        "run_key": run_key,
        "best_step": best_step,
        "val_auc": val_auc,
        "model_config": config.model.model_dump(mode="json"),
        "feature_stats": json.loads(stats.to_json()),
        "tags": dict(config.cost.tags),
    }
    write_json_atomic(out_dir / "model.json", meta)
    return {"uri": str(out_dir / "model.pt"), "sha256": sha, "meta_sha256": meta_sha256(out_dir)}
