"""What the end of training makes, on rank 0, once `Trainer.fit` has returned: the model
package of the best checkpoint and `result.json` (written last: it marks the run done), or, for
a tuning trial paused at a rung, `rungs/step-<n>.json`; on an s3:// root, each published.

The Trainer trains; this module is the run's record of it. Both wait for the checkpoints in
flight and their uploads first: a result never names a model or a rung that is not durable.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from training.cost.cpu_step import CpuScaling
from training.cost.step_count import StepCosts, StepCount
from training.model.model_ref import ModelRef
from training.model.package import export_model_package
from training.protocol.events import Paused
from training.protocol.results import AutoBatch, BatchLayout, CheckpointUpload, LoaderWorkers, RungResult, StepMode, TrainResult
from training.protocol.runs import AttemptRecord, append_attempt, rung_file, step_dir_name
from training.storage.files import write_json_atomic
from training.storage.root import MODEL, RUN
from training.trainer.checkpoint import load_checkpoint_state
from training.trainer.precision import measure_fp32_slowdown
from training.trainer.throughput import accelerator_stats
from training.trainer.trainer import steady_step_seconds
from training.copies import updated

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from training.trainer.trainer import Trainer

__all__ = ["finish_run", "pause_run"]


def _settle(trainer: Trainer) -> None:
    """The checkpoints written, and uploaded when the root is on S3."""
    trainer.checkpointer.wait()
    uploader = trainer.book.uploader
    if uploader is not None:
        uploader.flush()
        uploader.close()


def pause_run(trainer: Trainer) -> RungResult:
    """Record a stop at a tuning rung: the rung's result, beside the checkpoint the next rung
    resumes from. A pause is not a preemption: the ledger records it so the report does not
    count it as one."""
    _settle(trainer)
    job, progress = trainer.job, trainer.state.progress
    append_attempt(trainer.run_dir / "attempts.jsonl", AttemptRecord(paused_at=progress.step))
    best = trainer.state.stopper.best
    rung = RungResult(run_key=job.run_key, status="paused", step=progress.step, metric=trainer.metric,
                      value=float("nan") if best is None else best, billed_seconds=progress.billed_seconds(),
                      steps_lost=progress.steps_lost, preemptions=progress.preemptions,
                      startup_seconds=progress.seconds.startup)
    write_json_atomic(trainer.run_dir / rung_file(progress.step), rung.to_json())
    root = trainer.book.root
    if root is not None:
        root.publish(f"{job.run_rel}/attempts.jsonl", RUN, job.run_key)
        root.publish(f"{job.run_rel}/{rung_file(progress.step)}", RUN, job.run_key)
    trainer.emit(Paused(step=progress.step, value=rung.value, metric=trainer.metric))
    return rung


def finish_run(trainer: Trainer, status: str) -> TrainResult:
    """Export the best checkpoint as the model package, write result.json and publish the run
    (result.json last: it marks the run done)."""
    _settle(trainer)  # the final and best checkpoints must be on disk before the export
    fp32_slowdown: float | None = 1.0 if trainer.precision == "fp32" else None
    if trainer.precision != "fp32" and trainer.tc.measure_fp32:
        fp32_slowdown = measure_fp32_slowdown(trainer.state.model, trainer.task, trainer.train_batches.batch(0, 0),
                                              trainer.device, trainer.precision)
    stopper, job = trainer.state.stopper, trainer.job
    assert stopper.best_step is not None  # every run validates at least once: at its last step
    best = load_checkpoint_state(trainer.run_dir / "checkpoints" / step_dir_name(stopper.best_step))["model"]
    package = export_model_package(trainer.run_dir / "model", best, trainer.config, trainer.stats, job.run_key,
                                   stopper.best_step, trainer.metric, stopper.best)
    result = _result(trainer, status, package, fp32_slowdown)
    result = updated(result, vars(_step_counts(trainer)))
    if status == "budget_stopped" and trainer.rank == 0:
        append_attempt(trainer.run_dir / "attempts.jsonl", AttemptRecord(budget_stopped_at=trainer.state.progress.step))
    write_json_atomic(trainer.run_dir / "result.json", result.to_json())
    root, rel, key = trainer.book.root, job.run_rel, job.run_key
    if root is not None:
        root.publish_all([f"{rel}/model/model.pt", f"{rel}/model/model.json"], MODEL, key)
        root.publish(f"{rel}/attempts.jsonl", RUN, key)
        root.publish(f"{rel}/result.json", RUN, key)  # last: the run is done
    return result


@dataclass(frozen=True)
class _StepCounts:
    """TrainResult's fields that count a step (see there)."""

    step_count: StepCount | None = None
    step_costs: StepCosts | None = None
    cpu_scaling: CpuScaling | None = None


def _step_counts(trainer: Trainer) -> _StepCounts:
    """One step counted as a GPU would run it, for the report's predicted-against-actual step
    time; with the memory-saving variants too when `retrain plan` calibrates."""
    from training.trainer.step_cost import count_step, measure_cpu_scaling, measure_step_costs

    batch, precision = trainer.train_batches.batch(0, 0), trainer.tc.precision
    try:
        if trainer.job.count_variants:
            costs = measure_step_costs(trainer.state.model, trainer.task, batch, precision)
            threads = trainer.threads if trainer.device.type == "cpu" else None
            scaling = None if threads is None else measure_cpu_scaling(trainer.state.model, trainer.task, batch,
                                                                       threads.threads, threads.usable_cpus)
            return _StepCounts(step_count=costs.as_run, step_costs=costs, cpu_scaling=scaling)
        dtype = None if precision == "fp32" else torch.bfloat16
        return _StepCounts(step_count=count_step(trainer.state.model, trainer.task, batch, dtype))
    except Exception as err:  # noqa: BLE001 - a user model the count cannot follow: the trained model matters more
        log.warning("could not count one training step (%s: %s); the report has no predicted step time",
                    type(err).__name__, str(err).splitlines()[0] if str(err) else "")
        return _StepCounts()


def _result(trainer: Trainer, status: str, package: ModelRef, fp32_slowdown: float | None) -> TrainResult:
    progress, stopper, tc = trainer.state.progress, trainer.state.stopper, trainer.tc
    assert progress.micro_batch is not None and stopper.best_step is not None
    uploader = trainer.book.uploader
    upload = None if uploader is None else CheckpointUpload(
        uploaded=len(uploader.uploaded), superseded=uploader.superseded, failures=uploader.failures,
        background_seconds=uploader.seconds)
    return TrainResult(
        run_key=trainer.job.run_key, status=status, stop_reason=progress.stop_reason, fp32_slowdown=fp32_slowdown,
        profile=trainer.profiler.summary() if trainer.profiler is not None else None, max_steps=tc.max_steps,
        eval_every=tc.validate_every, patience=tc.patience_validations,
        billed_seconds=progress.billed_seconds(), accelerator=accelerator_stats(trainer.device),
        steps=progress.step, best_step=stopper.best_step, metric=trainer.metric, best_val_metric=stopper.best,
        best_val_auc=stopper.best if trainer.metric == "auc" else None, precision=trainer.precision,
        device=trainer.device.type, model=package, history=progress.history,
        resumed_from_steps=progress.resumed_from_steps, preemptions=progress.preemptions,
        steps_lost=progress.steps_lost, seconds=progress.seconds.model_copy(),
        steady_step_seconds=steady_step_seconds(trainer.step_durations),
        first_step_latency_seconds=trainer.first_step_latency,
        restart_to_first_step_seconds=progress.restart_to_first_step_seconds,
        checkpoints_saved=progress.checkpoints_saved,
        checkpoint_background_seconds=trainer.checkpointer.background_seconds,
        checkpoint_interval=trainer.schedule.describe(progress),
        samples_seen=progress.step * progress.micro_batch * trainer.grad_accum,  # the micro-batch is global
        batch_layout=BatchLayout(micro_batch=progress.micro_batch, grad_accum=trainer.grad_accum,
                                 auto=AutoBatch.model_validate(progress.auto_batch) if progress.auto_batch else None, peak_lr=tc.peak_lr()),
        num_workers=LoaderWorkers(used=trainer.num_workers, probe=trainer.workers_probe, resident=trainer.resident),
        threads=trainer.threads,
        compile_seconds=trainer.compile_seconds, world_size=trainer.world_size, checkpoint_upload=upload,
        step_mode=StepMode(step="graph" if trainer.graphed is not None else "capturable" if trainer.capturable
                           else "eager", reason=trainer.step_reason, steps_per_block=trainer.k,
                           boundary_seconds=trainer.boundary_seconds),
    )
