from __future__ import annotations

import time

from prefect import task

from tasks.artifacts import TrainingProgress
from tasks.policies import forward_child_event, retry_only_preemptions, task_logger
from training.config import RetrainConfig
from training.errors import Preempted
from training.pipeline.handoffs import PackResult, PrepResult
from training.pipeline.train_stage import train_stage
from training.launch.events import CheckpointSaved, ChildEvent, Started, Validated
from training.launch.results import TrainResult

__all__ = ["train_model"]


def _where(saved: list[CheckpointSaved]) -> str:
    if not saved:
        return " before its first checkpoint (nothing saved to resume from)"
    kind = "emergency checkpoint" if saved[0].emergency else "checkpoint"
    return f" at step {saved[0].step}: {kind} written"


@task(name="train", retry_condition_fn=retry_only_preemptions)
def train_model(config: RetrainConfig, packed: PackResult, prep: PrepResult,
                champion_val_metric: float | None = None) -> TrainResult:
    """Train in a child process; a preemption raises Preempted, which is retried and resumes."""
    logger = task_logger()
    progress = TrainingProgress(config.train.max_steps)
    first: list[tuple[float, int]] = []  # (time, step) of the first validation this attempt: the ETA's origin

    saved: list[CheckpointSaved] = []  # the last checkpoint: where a stop left the run

    def log_event(event: ChildEvent) -> None:
        if isinstance(event, CheckpointSaved):
            saved[:] = [event]
        if isinstance(event, Started):  # the job's effective budget (a warm start's is its own)
            progress.max_steps = event.max_steps
            where = f"from step {event.step}, " if event.step else ""
            logger.info("training %sup to %d steps, a progress line every %d steps", where, event.max_steps,
                        event.validate_every)
        elif isinstance(event, Validated):
            progress.update(event.step)
            now, step = time.monotonic(), event.step
            if not first:
                first.append((now, step))
            t0, s0 = first[0]
            left = (now - t0) / (step - s0) * (event.max_steps - step) if step > s0 else None
            eta = "" if left is None else f"  ETA {left:.1f} s" if left < 10 else f"  ETA {left:.0f} s"
            logger.info("step %d/%d  train_loss %.4f  val_%s %.4f%s", step, event.max_steps,
                        event.validation.train_loss, event.metric, event.value, eta)
        else:
            forward_child_event(logger, event)

    logger.info("starting the training process")
    try:
        trained = train_stage(config, packed, prep, log_event, champion_val_metric)
    except Preempted:
        logger.warning("preempted%s; retrying resumes from it", _where(saved))
        raise
    except KeyboardInterrupt:
        logger.warning("interrupted (Ctrl-C)%s; the same command resumes from it", _where(saved))
        raise
    except BaseException as err:
        if saved and saved[0].emergency:  # this process is being stopped (SIGTERM: a spot reclaim)
            logger.warning("stopped by %s%s; the rescheduled flow run resumes from it", type(err).__name__,
                           _where(saved))
        raise
    progress.update(progress.max_steps)  # finished, whether completed or stopped early
    if trained.already_complete:
        logger.info("run %s was already complete: nothing to train", trained.run_key)
    return trained
