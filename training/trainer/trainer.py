"""The Trainer: set-up in the constructor, then `fit()` over `train_step`, `validate` and
`save`. `training.trainer.run.train(job)` runs it and publishes what it made.

What lives elsewhere, each in one file:
- the checkpointed state (model, optimizer, scheduler, scaler, early stopping, progress, RNGs):
  `training.trainer.state`;
- when to stop (budgets, plateau, champion gate, the DDP agreement): `training.trainer.stopping`;
- where to resume and what the last attempt lost (S3 restore, heartbeat): `training.trainer.resume`
  (the attempts ledger: `training.protocol.runs`);
- when and how to checkpoint: `training.trainer.checkpoint` (on S3: `checkpoint_sync`);
- what the end of training makes (the model package, result.json, a rung's record):
  `training.trainer.publish`.

Rank-aware through `rank`/`world_size` and free of module state, so it runs under torchrun.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator, cast

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from training.config import metric_name
from training.data.load.loader import (
    MixedBatches,
    ShardBatches,
    StreamPosition,
    TrainBatches,
    make_train_loader,
    worker_seconds_per_batch,
)
from training.data.manifest import require_manifest
from training.data.prepare.features import DERIVED_DIR, FeatureStats
from training.errors import ConfigError, Preempted, RetrainError
from training.model.evaluation import predict_split
from training.data.batch import Batch
from training.model.network import ModelSchema, forward_fn, to_device
from training.model.objectives import Task
from training.model.package import load_warm_start
from training.model.spec import adamw, train_spec, warmup_cosine
from training.model.task_metrics import TIEBREAK_METRIC, higher_is_better, metric_for
from training.protocol.events import CheckpointSaved, ChildEvent, RankDone, Resumed, Started, Validated
from training.protocol.job import TrainJob, train_fingerprint
from training.protocol.results import Validation
from training.protocol.runs import AttemptRecord, append_attempt
from training.protocol.threads import CpuClock, apply_thread_policy
from training.storage.files import read_pinned
from training.trainer.checkpoint import (
    AsyncCheckpointer,
    CheckpointManifest,
    CheckpointSchedule,
)
from training.trainer.precision import autocast_dtype, resolve_device, resolve_precision
from training.trainer.resume import ResumeBook
from training.trainer.rng import RngState, capture_rng, configure_determinism, seed_everything
from training.trainer.state import TrainState
from training.trainer.step import (
    CapturableStep,
    GraphedStep,
    ResidentInputs,
    StaticInputs,
    block_length,
    choose_k,
    clip_gradients,
    lr_table,
    step_support,
    sync_schedule,
)
from training.trainer.stopping import CONTINUE, StopFlag, StopPolicy, agree_across_ranks
from training.trainer.throughput import (
    auto_batch_layout,
    choose_num_workers,
    data_and_compute_seconds,
)

__all__ = ["EVAL_BATCH_SIZE", "StopFlag", "Trainer", "steady_step_seconds"]

log = logging.getLogger(__name__)
EVAL_BATCH_SIZE = 8192
# Below this many validation rows one split's metric is coarse and noisy (accuracy's standard
# error near 90 % is 1 point at 1,000 rows): said once, and ties are broken by the loss.
SMALL_VALIDATION_ROWS = 1000
STEP_DURATIONS = 2048  # enough for a steady per-step figure (plan's calibration, the report)
# train.compile auto: the most a compile was measured to save (the 6x384 transformer's 1.27x on
# an H200 is a fifth of its eager step), and what a compile costs before one was timed here.
COMPILE_GAIN = 0.2
COMPILE_SECONDS = 30.0
Emit = Callable[[ChildEvent], None]


def _quiet(event: ChildEvent) -> None:
    """Progress is rank 0's to report."""


def steady_step_seconds(durations: list[float]) -> float | None:
    """Seconds per step once warmed up: the mean over the steps after the first fifth (at least
    5; the allocator, thread pools and caches warm up there, and a short calibration that counted
    them would overstate every later step several times). None with fewer than 10 steps."""
    if len(durations) < 10:
        return None
    steady = durations[max(5, len(durations) // 5):]
    return sum(steady) / len(steady)


class Trainer:
    """One attempt at one run: builds everything, resumes, trains, exports."""

    def __init__(self, job: TrainJob, stop: StopFlag | None = None, emit: Emit = _quiet, rank: int = 0,
                 world_size: int = 1, now_fn: Callable[[], float] = time.perf_counter) -> None:
        self.job, self.config, self.tc = job, job.config, job.config.train
        self.stop = stop or StopFlag()
        self.emit_any_rank, self.emit = emit, (emit if rank == 0 else _quiet)
        self.rank, self.world_size, self.now = rank, world_size, now_fn
        self.spawn_time = float(os.environ.get("RETRAIN_SPAWN_TIME", time.time()))
        self.run_dir = Path(job.run_dir)
        # Set-up is the window in which other processes' load on this machine is measured.
        self.cpu_clock = CpuClock.read()
        # Before anything runs torch, a provisional count (the loader keeps a core); decided in
        # _build_loader once the loader is known.
        self.threads = apply_thread_policy(self.tc.loader.torch_threads, 0)
        self.device = resolve_device(self.tc.device)
        # The job's numerics are the parent's decision, made once for the run key (auto on a GPU
        # is measured: training.pipeline.precision_pick); a job built by hand resolves its own.
        self.precision = job.numerics[1] if job.numerics else resolve_precision(self.tc.precision, self.device)
        self.dtype = autocast_dtype(self.precision)
        self.fingerprint = train_fingerprint(self.config, self.device.type, self.precision)
        seed_everything(self.tc.seed)
        configure_determinism(self.tc.deterministic, self.device)
        self.dataset_dir = Path(job.dataset_dir)
        self.manifest = require_manifest(self.dataset_dir, job.manifest_sha256)
        # `auto` validation settings follow this dataset's train split (train.eval_every, train.patience).
        self.config = self.config.for_train_rows(self.manifest.train_rows)
        self.tc = self.config.train
        self.stats = FeatureStats.from_json(read_pinned(Path(job.stats_path), job.stats_sha256,
                                                        "the feature statistics").decode())
        # Token ids and pixels stored by preprocessing beside the statistics (see features.py).
        self.transform = self.stats.transformer(Path(job.stats_path).parent / DERIVED_DIR, job.derived_sha256)
        self.task = Task.of(self.stats)
        self.metric = metric_for(self.stats.task, self.config.eval.metric)
        higher = higher_is_better(self.stats.task, self.metric)
        self.val_batches = ShardBatches(self.dataset_dir, self.manifest, "validation", EVAL_BATCH_SIZE,
                                        self.transform, shuffle=False, drop_last=False)
        self._say_if_validation_is_small()
        self.state = TrainState.create(self.config, ModelSchema.of(self.stats), self.device, self.precision, higher)
        self.book = ResumeBook(job, rank, world_size, self.spawn_time)
        self._resume()
        uploader = self.book.uploader
        self.checkpointer = AsyncCheckpointer(self.run_dir / "checkpoints", self.tc.checkpoint.keep_last,
                                              on_published=uploader.submit if uploader else None,
                                              in_use=uploader.in_flight if uploader else set)
        self.book.make_resume_point_durable()
        self.schedule = CheckpointSchedule(*self.tc.checkpoint.interval(), self.tc.checkpoint.mean_seconds_between_preemptions)
        self._decide_layout()
        self._build_loader()
        self._compile()
        self._build_step()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)  # the peak reported is the loop's, not the probes'
        self.policy = StopPolicy(self.config, job.rate_per_hour, job.gpus, job.champion_val_metric, self.metric, higher)
        self._continue_past_a_budget()
        if self.book.resumed_step is None:
            self.state.progress.seconds.pre_train = job.pre_train_seconds  # once per run, not per attempt
        self.profiler = None
        if self.tc.profile:
            from training.trainer.profiling import StepProfiler

            self.profiler = StepProfiler(self.run_dir / "profile", self.device)
        self.stop_agreed = False  # under DDP: the stop request all ranks agreed on last step
        self.rows_seen = 0
        self.first_step_latency: float | None = None
        self.step_durations: list[float] = []  # the attempt's first STEP_DURATIONS steps' wall time
        self.saved_step: int | None = None
        self._last = 0.0

    # -- set-up ---------------------------------------------------------------------------

    def _resume(self) -> None:
        """Load the newest checkpoint of this run, or warm-start a fresh one; then account."""
        self.book.restore_remote()
        saved = self.book.latest_checkpoint(self.fingerprint)
        if saved is not None:
            self.state.load_state_dict(saved, self.rank, self.world_size)
            log.info("resuming from %s (step %d)", self.book.resumed_from, self.state.progress.step)
            self.emit(Resumed(step=self.state.progress.step, checkpoint=str(self.book.resumed_from)))
        elif self.job.init_weights is not None:
            load_warm_start(self.state.model, Path(self.job.init_weights), self.job.init_sha256,
                            self.job.init_classes, self.stats.classes)
        self.book.account(self.state.progress)

    def _say_if_validation_is_small(self) -> None:
        """One line where a validation split is too small for its metric to pick a step alone."""
        rows = self.manifest.rows["validation"]
        if self.rank != 0 or not 0 < rows < SMALL_VALIDATION_ROWS:
            return
        metric, tiebreak = metric_name(self.metric), metric_name(TIEBREAK_METRIC[self.task.name])
        if self.task.name == "regression" or metric == tiebreak:  # a continuous metric: noisy, not coarse
            log.warning("the validation split holds %d rows: validation %s is noisy there, and the step early "
                        "stopping keeps may not be the best model. More rows, or a larger data.validation_fraction, "
                        "make the choice firmer",
                        rows, metric)
        else:
            log.warning("the validation split holds %d rows: validation %s is coarse and noisy there, so early "
                        "stopping keeps, among equal %s values, the step with the lowest validation %s. More rows, "
                        "or a larger data.validation_fraction, make the choice firmer", rows, metric, metric, tiebreak)

    def _continue_past_a_budget(self) -> None:
        """A run resumed from the checkpoint its budget stopped it at trains on when the budget
        it runs with now allows more (the launcher asked the same before starting it)."""
        progress = self.state.progress
        if progress.stopped == "budget_stopped" and self.policy.budget.exceeded(progress, 0) is None:
            log.info("stopped at step %d by its budget (%s); the budget allows more now: training on", progress.step,
                     progress.stop_reason)
            progress.stopped, progress.stop_reason = None, None

    def _decide_layout(self) -> None:
        """The micro-batch layout, decided at the run's first start and kept in the checkpoint,
        so a resume batches identically."""
        progress, tc = self.state.progress, self.tc
        if progress.micro_batch is None:
            progress.micro_batch, progress.grad_accum = tc.batch_size, tc.grad_accum
            train_rows = sum(s.rows for s in self.manifest.shards_of("train"))
            if train_rows < progress.micro_batch:
                # Small data trains with the defaults, as in peers: one batch is the whole split.
                progress.micro_batch = max(self.world_size, train_rows // self.world_size * self.world_size)
                log.warning("the train split has %d rows, fewer than train.batch_size %d: training with batches "
                            "of %d rows (the whole split)", train_rows, tc.batch_size, progress.micro_batch)
            if tc.auto_batch_size:
                progress.micro_batch, progress.grad_accum, search = auto_batch_layout(
                    self.state.model, self.task, tc, self.val_batches.batch(0, 0), self.device, self.dtype,
                    self.world_size)
                progress.auto_batch = search.model_dump(mode="json") if search is not None else None
        self.grad_accum = int(progress.grad_accum or tc.grad_accum)

    def _train_batches(self, batch_size: int, cache_bytes: int) -> TrainBatches:
        """The train split's batches; a warm start's mix the segments new since the champion
        into every batch, with old ones replayed (`MixedBatches`)."""
        keys = {s.key for s in self.manifest.segments}
        new = set(self.job.new_segments or ()) & keys
        new_train = self.manifest.restricted_to(new).shards_of("train") if new else []
        old_train = self.manifest.restricted_to(keys - new).shards_of("train") if new else []
        if new_train and old_train:  # both parts hold train rows (a split key may send a file elsewhere)
            mixed = MixedBatches(self.dataset_dir, self.manifest, new, batch_size, self.transform, self.tc.seed,
                                 cache_bytes, self.tc.new_data_weight)
            log.info("warm start: %d of every %d rows from the %d segment(s) new since the champion", mixed.new_rows,
                     batch_size, len(new))
            return mixed
        return ShardBatches(self.dataset_dir, self.manifest, "train", batch_size, self.transform, seed=self.tc.seed,
                            cache_bytes=cache_bytes)

    def _build_loader(self) -> None:
        """The endless train stream from the saved data position; `num_workers: auto` is probed
        at the run's first start only."""
        progress, tc = self.state.progress, self.tc
        assert progress.micro_batch is not None  # decided by _decide_layout
        # The global micro-batch is split across the processes; the node's ranks share its cache.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self.train_batches = self._train_batches(progress.micro_batch // self.world_size,
                                                 int(tc.loader.cache_mb * 1e6) // local_world)
        self.workers_probe = None
        num_workers = tc.loader.num_workers
        self.resident = self._held_resident()
        if self.resident:
            num_workers = 0  # the batches are gathered on the device: nothing for a worker to do
        elif num_workers == "auto" and progress.num_workers is not None:
            num_workers = progress.num_workers
        elif num_workers == "auto":
            batches = self.train_batches
            self.workers_probe = choose_num_workers(
                self.state.model, self.task, lambda i: batches.batch(0, i % batches.batches_per_epoch), self.device,
                self.dtype, lambda k: worker_seconds_per_batch(batches, k, self.rank, self.world_size))
            num_workers = progress.num_workers = self.workers_probe.num_workers
        self.num_workers = int(num_workers)
        self._decide_threads()
        self.loader = make_train_loader(
            self.train_batches, StreamPosition(progress.epoch, progress.batch), self.num_workers,
            pin_memory=self.device.type == "cuda" and not self.resident, rank=self.rank, world=self.world_size)
        source: Any = self.loader.dataset if isinstance(self.loader, DataLoader) else self.loader
        self.per_epoch = source.per_epoch  # global batches per epoch

    def _held_resident(self) -> bool:
        """The train split on the device when train.loader.resident asks and it fits
        (training.data.load.resident); the stream otherwise."""
        from training.data.load.resident import ResidentBatches, resident_bytes

        setting, batches = self.tc.loader.resident, self.train_batches
        if setting is False or not isinstance(batches, ShardBatches) or (
                setting == "auto" and self.device.type != "cuda"):
            return False
        need = resident_bytes(batches)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            room = free * self.tc.loader.resident_memory_fraction
        else:
            room = float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) * self.tc.loader.resident_memory_fraction
        if need > room:
            log.info("the train split (%.0f MB transformed) does not fit in %.0f MB of %s memory: streaming it",
                     need / 1e6, room / 1e6, self.device.type)
            return False
        self.train_batches = ResidentBatches(batches, self.device)
        log.info("the train split is held on %s (%.0f MB): batches are gathered there", self.device, need / 1e6)
        return True

    def _decide_threads(self) -> None:
        """The run's intra-op threads, from the loader now known and the other processes'
        load measured over set-up; kept from the first attempt on a resume (same numerics)."""
        progress, probe = self.state.progress, self.workers_probe
        decide = self.tc.loader.torch_threads == "auto" and progress.torch_threads is None
        if probe is not None:
            t_data, t_compute = probe.data_seconds_per_batch, probe.compute_seconds_per_batch
        elif decide and self.num_workers == 0:
            batches = self.train_batches  # the prefetch thread's load, as the workers probe measures it
            t_data, t_compute = data_and_compute_seconds(
                self.state.model, self.task, lambda i: batches.batch(0, i % batches.batches_per_epoch), self.device,
                self.dtype, probes=3)
        else:
            t_data, t_compute = 0.0, 0.0
        loader_busy = round(t_data / t_compute, 4) if t_compute > 0 else None
        others = CpuClock.read_after(self.cpu_clock).others_busy_since(self.cpu_clock) if decide else 0.0
        self.threads = apply_thread_policy(self.tc.loader.torch_threads, self.num_workers, others, loader_busy,
                                           kept=progress.torch_threads)
        if self.tc.loader.torch_threads == "auto":
            progress.torch_threads = self.threads.threads

    def _compile(self) -> None:
        """torch.compile (warmed up now, outside the step timings) where train.compile asks or,
        with auto, pays; then DDP around the model."""
        model = self.state.model
        self.compile_seconds = None
        compiled: torch.nn.Module = model
        if self._compile_pays():
            t0 = time.perf_counter()
            candidate = cast(torch.nn.Module, torch.compile(model))
            self._warm_up(candidate)
            self.compile_seconds = self.state.progress.compile_seconds = time.perf_counter() - t0
            compiled = candidate
            if self.tc.compile == "auto":
                eager_s, compiled_s = self._passes_seconds(model), self._passes_seconds(candidate)
                if compiled_s >= eager_s:
                    log.info("train.compile auto: the compiled step took %.2f ms against %.2f ms eager: running eagerly",
                             1e3 * compiled_s, 1e3 * eager_s)
                    compiled = model
            if self.num_workers:
                self.train_batches.release()
        self.compiled = compiled is not model
        self.ddp = None
        if self.world_size > 1:
            # After the resume: every rank loaded the same checkpoint, and DDP checks it by
            # broadcasting rank 0's parameters. Gradients are averaged in buckets during backward.
            self.ddp = torch.nn.parallel.DistributedDataParallel(compiled, bucket_cap_mb=self.tc.distributed.bucket_mb)
        self.forward = forward_fn(self.ddp if self.ddp is not None else compiled, model)

    def _compile_pays(self) -> bool:
        """train.compile auto: on a CUDA device, when the steps left at the most a compile was
        measured to save (COMPILE_GAIN of an eager step: the transformer's 1.27x on an H200; the
        default MLP's was 0.99x) outweigh the compile's seconds (this run's last attempt's, kept
        in its checkpoint, else COMPILE_SECONDS)."""
        setting = self.tc.compile
        if setting != "auto":
            return bool(setting)
        if self.device.type != "cuda":
            return False
        left = self.tc.max_steps - self.state.progress.step
        batches = self.train_batches
        _, eager = data_and_compute_seconds(self.state.model, self.task,
                                            lambda i: batches.batch(0, i % batches.batches_per_epoch), self.device,
                                            self.dtype, probes=3)
        cost = self.state.progress.compile_seconds or COMPILE_SECONDS
        pays = left * eager * COMPILE_GAIN > cost
        log.info("train.compile auto: %d steps left at %.2f ms would save at most %.0f s against about %.0f s of "
                 "compiling: %s", left, 1e3 * eager, left * eager * COMPILE_GAIN, cost,
                 "compiling" if pays else "not compiling")
        return pays

    def _passes_seconds(self, module: torch.nn.Module, passes: int = 5) -> float:
        """Seconds per forward and backward of `module` on a micro-batch, the model's state (its
        gradients, buffers and the RNG streams) left as it was."""
        model = self.state.model
        buffers = {name: b.clone() for name, b in model.named_buffers()}
        rows = self.train_batches.batch(0, 0).map(lambda v: v.to(self.device))
        forward = forward_fn(module, model)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            self.task.forward_loss(forward, rows, self.device, self.dtype).backward()  # warm
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            for _ in range(passes):
                self.task.forward_loss(forward, rows, self.device, self.dtype).backward()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            seconds = (time.perf_counter() - t0) / passes
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
        return seconds

    def _warm_up(self, compiled: torch.nn.Module) -> None:
        """One forward and backward of the compiled model as the loop runs them (grad mode,
        autocast, train mode, a whole micro-batch), so that step 1 reuses the graph instead of
        recompiling, and the compile's seconds stay out of `seconds.train` and plan's step
        times. Weights, gradients, buffers (BatchNorm's running statistics) and the RNG streams
        are left as they were: a compiled run computes what an uncompiled one does."""
        model = self.state.model
        buffers = {name: b.clone() for name, b in model.named_buffers()}
        rows = self.train_batches.batch(0, 0).map(lambda v: v.to(self.device))
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            self.task.forward_loss(forward_fn(compiled, model), rows, self.device, self.dtype).backward()
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])

    def _block_period(self) -> int:
        """The steps a block must never step over: validations and step-counted checkpoints."""
        mode, every = self.tc.checkpoint.interval()
        return math.gcd(self.tc.validate_every, int(every)) if mode == "steps" else self.tc.validate_every

    def _build_step(self) -> None:
        """Which step runs (train.step: see training.trainer.step), and how many steps a block
        holds to start with (train.steps_per_block; auto adapts it as steps are timed)."""
        tc, progress = self.tc, self.state.progress
        self.period = self._block_period()
        self.k = 1 if tc.steps_per_block == "auto" else tc.steps_per_block
        if self.period % self.k:
            raise ConfigError(f"train.steps_per_block {self.k} must divide train.eval_every {tc.validate_every} (and a "
                              "step-counted train.checkpoint.every): set it to a divisor, or auto")
        self.boundary_seconds: float | None = None  # a block's host work, averaged
        self.agree_seconds = 0.0  # the ranks' last agreement
        self.capturable: CapturableStep | None = None
        self.graphed: GraphedStep | None = None
        self.graph_warmup = 0
        self.step_reason: str | None = None
        if tc.step == "eager" or (tc.step == "auto" and self.device.type != "cuda"):
            self.step_reason = "train.step eager" if tc.step == "eager" else f"no CUDA graphs on {self.device.type}"
            return
        spec = train_spec(self.config.model)
        built_in = spec.build_optimizer is adamw and spec.build_scheduler is warmup_cosine
        why = step_support(self.state.optimizer, self.state.scheduler, built_in, self.precision, self.world_size)
        if why is not None:
            (log.warning if tc.step == "graph" else log.info)("train.step %s: the step runs eagerly: %s", tc.step, why)
            self.step_reason = why
            return
        assert progress.micro_batch is not None
        inputs: ResidentInputs | StaticInputs = StaticInputs(self.grad_accum)
        if self.resident:
            # Room for the longest block: an explicit steps_per_block, or what auto may choose.
            capacity = max(self.k, min(self.period, 256))
            inputs = ResidentInputs(self.train_batches.tensors, self.grad_accum,  # type: ignore[attr-defined]
                                    progress.micro_batch, capacity, self.device)
        table = lr_table(tc, float(self.state.scheduler.base_lrs[0]), self.device)
        self.capturable = CapturableStep(self.state.model, self.forward, self.task, self.state.optimizer, table, tc,
                                         self.grad_accum, self.device, self.dtype, inputs)
        self.capturable.sync(progress.step)
        if self.device.type == "cuda":
            self.graphed, self.graph_warmup = GraphedStep(self.capturable), 2
            log.info("train.step %s: the step is captured as a CUDA graph after %d warm-up steps", tc.step,
                     self.graph_warmup)
        else:
            log.info("train.step graph: %s has no CUDA graphs; the capturable step runs as it is", self.device.type)
            self.step_reason = f"no CUDA graphs on {self.device.type}"

    # -- the loop -------------------------------------------------------------------------

    def fit(self) -> str:
        """Train to the end or an early stop (or to `job.pause_at`); how it ended: completed,
        early_stopped, budget_stopped, or paused (at a tuning rung, with a checkpoint there).
        Raises `Preempted` after an emergency checkpoint when asked to stop. What is made of
        the end (the package, result.json, the rung record) is `training.trainer.publish`'s."""
        progress, max_steps = self.state.progress, self.tc.max_steps
        self.emit(Started(step=progress.step, max_steps=max_steps, validate_every=self.tc.validate_every))
        # A captured step on the resident split gathers its own rows: no stream to iterate.
        batches: Iterator[Any] = iter(()) if self._gathers_in_step() else iter(self.loader)
        self.state.model.train()
        status = progress.stopped or "completed"
        self._last = self.now()
        pause_at = self.job.pause_at
        while progress.step < max_steps and progress.stopped is None:
            if pause_at is not None and progress.step >= pause_at:
                self._stop_at_rung(batches)  # a tuning rung: the study decides whether to go on
                return "paused"
            # One process decides alone; under DDP every rank acts on the flag they agreed on at
            # the end of the last block, so all of them stop at the same step.
            if self.stop_agreed if self.world_size > 1 else self.stop.requested:
                self._preempt(batches)
            if self.checkpointer.failed:
                self.checkpointer.wait()  # raises the save's error: steps past a failed save would be lost
            k = block_length(progress.step, self.k, [max_steps, pause_at or 0])
            loss = self._run_block(batches, k)
            status = self._after_block(loss)
            if status != "completed":
                log.info("stopping at step %d: %s", progress.step, progress.stop_reason)
                break
        self._release(batches)
        self.emit_any_rank(RankDone(rank=self.rank, rows=self.rows_seen, step=progress.step))
        if self.profiler is not None:
            self.profiler.close()
        return status

    def train_step(self, batches: Iterator[Any]) -> torch.Tensor:
        """One optimizer step over `grad_accum` micro-batches; the step's summed loss."""
        state, progress, now, seconds = self.state, self.state.progress, self.now, self.state.progress.seconds
        device, ddp, grad_accum = self.device, self.ddp, self.grad_accum
        state.optimizer.zero_grad(set_to_none=True)
        loss_sum: torch.Tensor | None = None
        for micro in range(grad_accum):
            t_wait = now()
            epoch, index, batch = next(batches)
            if device.type != "cpu":
                batch = to_device(batch, device, non_blocking=True, cut_text=not self.compiled)
            t_compute = now()
            seconds.data_wait += t_compute - t_wait
            self.rows_seen += batch.rows
            # Under DDP only the last micro-batch all-reduces: the others accumulate locally.
            sync = ddp.no_sync() if ddp is not None and micro < grad_accum - 1 else contextlib.nullcontext()
            with sync:
                loss = self._loss(batch)
                state.scaler.scale(loss).backward()
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
            seconds.compute += now() - t_compute
        assert loss_sum is not None  # grad_accum >= 1: at least one micro-batch ran
        progress.epoch, progress.batch = divmod(epoch * self.per_epoch + index + 1, self.per_epoch)
        if self.tc.optim.grad_clip > 0:
            state.scaler.unscale_(state.optimizer)
            clip_gradients([p.grad for p in state.model.parameters() if p.grad is not None], self.tc.optim.grad_clip)
        state.scaler.step(state.optimizer)
        state.scaler.update()
        state.scheduler.step()
        progress.step += 1
        return loss_sum

    def _gathers_in_step(self) -> bool:
        return self.capturable is not None and isinstance(self.capturable.inputs, ResidentInputs)

    def _run_block(self, batches: Iterator[Any], k: int) -> torch.Tensor:
        """`k` steps back to back, then the block's timing and heartbeat; the last step's loss."""
        progress = self.state.progress
        if self.capturable is not None and isinstance(self.capturable.inputs, ResidentInputs):
            first = progress.epoch * self.per_epoch + progress.batch
            self.capturable.inputs.start_block(
                self.train_batches.positions(first, k * self.grad_accum, self.per_epoch))  # type: ignore[attr-defined]
        loss: torch.Tensor | None = None
        # A range a profile names: the GPU check measures the GPU's busy share of the steps' own
        # span (validation, checkpoints and set-up are outside it). Next to free unprofiled.
        with torch.profiler.record_function("retrain.steps"):
            for _ in range(k):
                loss = self.train_step(batches) if self.capturable is None else self._capturable_step(batches)
                if self.profiler is not None:
                    self.profiler.step()
        assert loss is not None  # k >= 1
        if self.capturable is not None:
            sync_schedule(self.state.scheduler, self.state.optimizer, progress.step)
        self._end_block(k)
        return loss

    def _capturable_step(self, batches: Iterator[Any]) -> torch.Tensor:
        """One step of the capturable kind: its batches into the static buffers (streamed) or
        its position advanced (resident: the rows are gathered inside the step), then the step,
        captured, replayed or eager."""
        progress, step = self.state.progress, self.capturable
        assert step is not None
        if isinstance(step.inputs, StaticInputs):
            micro = []
            for _ in range(self.grad_accum):
                t_wait = self.now()
                epoch, index, batch = next(batches)
                if self.device.type != "cpu":
                    batch = to_device(batch, self.device, non_blocking=True, cut_text=False)  # one shape: no cut
                progress.seconds.data_wait += self.now() - t_wait
                self.rows_seen += batch.rows
                micro.append(batch)
            step.inputs.load(micro, copy=self.graphed is not None and self.graphed.graph is not None)
            progress.epoch, progress.batch = divmod(epoch * self.per_epoch + index + 1, self.per_epoch)
        else:
            assert progress.micro_batch is not None
            self.rows_seen += progress.micro_batch * self.grad_accum
            progress.epoch, progress.batch = divmod(progress.epoch * self.per_epoch + progress.batch + self.grad_accum,
                                                    self.per_epoch)
        t_compute = self.now()
        loss = self._graph_or_eager()
        progress.seconds.compute += self.now() - t_compute
        progress.step += 1
        return loss

    def _graph_or_eager(self) -> torch.Tensor:
        """The captured step's replay; before it, its warm-up steps, then its capture (which
        records the step without running it, so the step is then replayed); eager where there is
        no graph, or its capture failed."""
        graphed, step = self.graphed, self.capturable
        assert step is not None
        if graphed is None:
            return step()
        if graphed.graph is None:
            if self.graph_warmup > 0:
                self.graph_warmup -= 1
                return graphed.warm_up()
            try:
                graphed.capture()
            except RuntimeError as err:  # an op in the step that a graph cannot hold: say which, go on eagerly
                log.warning("train.step %s: capturing the step as a CUDA graph failed (%s); it runs eagerly",
                            self.tc.step, str(err).splitlines()[0] if str(err) else type(err).__name__)
                self.graphed, step.autocast_cache = None, True
                self.step_reason = f"capture failed: {str(err).splitlines()[0][:200] if str(err) else type(err).__name__}"
                return step()
        return graphed()

    def _end_block(self, k: int) -> None:
        """The block's time (spread evenly over its steps), the heartbeat, the first step's latency."""
        progress, seconds = self.state.progress, self.state.progress.seconds
        t_end = self.now()
        span = t_end - self._last
        seconds.train += span
        room = STEP_DURATIONS - len(self.step_durations)
        if room > 0:
            self.step_durations.extend([span / k] * min(k, room))
        self._last = t_end
        self.book.heartbeat.write(progress.step, seconds.train)
        if self.first_step_latency is None:
            self.first_step_latency = time.time() - self.spawn_time
            if self.book.resumed_step is not None:
                progress.restart_to_first_step_seconds.append(self.first_step_latency)

    def _loss(self, batch: Batch) -> torch.Tensor:
        # Divided by the accumulation steps, so the summed gradient is a mean.
        loss = self.task.forward_loss(self.forward, batch, self.device, self.dtype)
        return loss / self.grad_accum if self.grad_accum > 1 else loss

    def _after_block(self, loss_sum: torch.Tensor) -> str:
        """Validate when due, decide whether to stop, agree across ranks, checkpoint when due;
        then choose the next block's length from what this block's host work cost."""
        progress, tc, leader = self.state.progress, self.tc, self.rank == 0
        t0, timed_before = self.now(), progress.seconds.eval + progress.seconds.checkpoint
        improved = False
        validated = progress.step % tc.validate_every == 0 or progress.step == tc.max_steps
        if validated and self.world_size > 1:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)  # the global batch's loss, as with one process
        if validated and leader:
            improved = self.validate(float(loss_sum))
        decision = self.policy.decide(progress, self.state.stopper, validated) if leader else CONTINUE
        if decision.validate_first:
            improved = self.validate(float(loss_sum))  # the best model must be validated before we stop
        status = decision.status
        if decision.reason is not None:
            progress.stop_reason = decision.reason
        save_now = self.schedule.due(progress) or improved or status != "completed" or progress.step == tc.max_steps
        k = self._next_k(self.now() - t0 - (progress.seconds.eval + progress.seconds.checkpoint - timed_before)
                         + self.agree_seconds)
        if self.world_size > 1:
            t_agree = self.now()
            self.stop_agreed, status, save_now, k = agree_across_ranks(self.stop.requested, status, save_now,
                                                                       self.rank, self.device, k)
            self.agree_seconds = self.now() - t_agree  # counted in the next block's host work
        self.k = k
        if status != "completed":
            progress.stopped = status  # in the final checkpoint: a run finished again from it stops at once
        if save_now:
            self.save()
        self._last = self.now()  # checkpoint and eval time are accounted separately
        return status

    def _next_k(self, boundary: float) -> int:
        """train.steps_per_block auto: the fewest steps a block at which its host work (measured
        now, averaged) costs under 2 % of its steps (`choose_k`); a number: that number."""
        if self.tc.steps_per_block != "auto":
            return self.k
        before = self.boundary_seconds
        self.boundary_seconds = boundary if before is None else 0.8 * before + 0.2 * boundary
        recent = self.step_durations[-32:]
        step_seconds = sum(recent) / len(recent) if recent else 0.0
        return choose_k(self.boundary_seconds, step_seconds, self.period)

    def validate(self, train_loss: float) -> bool:
        """Every validation metric of the task at this step into the history (`val_<metric>`);
        True when eval.metric reached a new best."""
        progress, t0 = self.state.progress, self.now()
        pred, labels = predict_split(self.state.model, self.task, self.val_batches, self.device, self.dtype)
        metrics = self.task.evaluate(labels, pred)
        better = self.state.stopper.update(metrics[self.metric], progress.step, metrics[TIEBREAK_METRIC[self.task.name]])
        validation = Validation(step=progress.step, train_loss=train_loss, metrics=metrics,
                                lr=float(self.state.scheduler.get_last_lr()[0]))
        progress.history.append(validation)
        progress.seconds.eval += self.now() - t0
        self.emit(Validated(validation=validation, metric=self.metric, max_steps=self.tc.max_steps,
                            spent_seconds=progress.billed_seconds()))
        return better

    def save(self, emergency: bool = False) -> None:
        """Checkpoint the TrainState. Called on every rank at the same step (the RNG gather is a
        collective); rank 0 writes."""
        t0, progress = self.now(), self.state.progress
        rng = capture_rng()
        rng_per_rank: list[RngState] | None = None
        if self.world_size > 1:
            gathered: list[object] = [None] * self.world_size
            dist.all_gather_object(gathered, rng)
            rng_per_rank = cast("list[RngState]", gathered)
        if self.rank != 0:
            return
        # Accounting first, so the saved state already counts this save.
        progress.checkpoints_saved += 1
        progress.last_save_train_seconds = progress.seconds.train
        history = progress.history
        val_auc = history[-1].metrics.get("auc") if history and history[-1].step == progress.step else None
        manifest = CheckpointManifest(progress.step, self.job.run_key, self.fingerprint, {}, val_auc=val_auc,
                                      emergency=emergency, extra={"tags": dict(self.config.cost.tags)})
        protect = {s for s in (self.state.stopper.best_step, self.book.resumed_step) if s is not None}
        # Emergency saves block: the process exits right after. Others write in the background
        # and the loop only waits for the in-memory copy.
        self.checkpointer.save(manifest, self.state.state_dict(rng, rng_per_rank), protect, blocking=emergency)
        self.saved_step = progress.step
        progress.record_save_cost(self.now() - t0)
        self.emit(CheckpointSaved(step=progress.step, emergency=emergency))

    def _preempt(self, batches: Iterator[Any]) -> None:
        """Emergency checkpoint, made durable, then `Preempted` on every rank."""
        self.save(emergency=True)
        uploader = self.book.uploader
        if uploader is not None:
            # The local disk of a spot machine dies with it: the emergency checkpoint counts
            # only once it is on S3.
            try:
                uploader.flush()
            except RetrainError as err:
                log.error("emergency checkpoint stayed local: %s", err)
        self._release(batches)
        if self.stop.reason == "SIGINT" and self.rank == 0:  # Ctrl-C: the user's stop, not a reclaim
            append_attempt(self.run_dir / "attempts.jsonl", AttemptRecord(interrupted_at=self.state.progress.step))
        if self.world_size > 1:
            dist.barrier()  # nobody exits (and makes torchrun kill the rest) before rank 0 wrote
        raise Preempted(f"stopped at step {self.state.progress.step}: "
                        f"{self.stop.reason or 'another rank was stopped'}", step=self.state.progress.step)

    def _stop_at_rung(self, batches: Iterator[Any]) -> None:
        """A checkpoint at this step (the next rung resumes from it, bit for bit), on every rank:
        the RNG gather is a collective."""
        progress = self.state.progress
        if self.saved_step != progress.step and self.book.resumed_step != progress.step:
            self.save()
        self._release(batches)

    def _release(self, batches: Iterator[Any]) -> None:
        self.book.heartbeat.close()
        # The train stream is endless, so its worker processes are still prefetching when the
        # loop ends; stop them now rather than at garbage collection.
        shutdown = getattr(batches, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
