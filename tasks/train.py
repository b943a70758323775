from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from uuid import UUID

from prefect import runtime, task

from tasks.artifacts import TrainingProgress
from tasks.policies import HOUR, TRAIN_TIMEOUT, forward_child_event, retried, retry_only_preemptions, task_logger
from training.config import RetrainConfig
from training.errors import Preempted
from training.pipeline.handoffs import PackResult, PrepResult
from training.pipeline.train_stage import train_stage
from training.protocol.events import CheckpointSaved, ChildEvent, Started, Validated
from training.protocol.results import TrainResult
from training.registry.champion import Champion

__all__ = ["find_champion", "record_preemption", "train_model"]


@dataclass
class _Preemption:
    """The train task run this process is being stopped in (SIGTERM: a spot reclaim, a node
    drain), after its training child wrote an emergency checkpoint."""

    task_run_id: UUID
    message: str


_PREEMPTED: list[_Preemption] = []
_CRASH_LINE = "Crash detected! Execution was aborted by a termination signal."


class _PreemptionIsNotACrash(logging.Filter):
    """Prefect's engines log every termination signal as an ERROR crash: the task's "Crash
    detected!" and "Finished in state Crashed(...)", then the flow's. A stop after the emergency
    checkpoint is the designed path of a spot reclaim: said as a warning, in words."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if _PREEMPTED and text.startswith(_CRASH_LINE):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg, record.args = _PREEMPTED[-1].message, ()
        elif _RESCHEDULED and text.startswith(_FINISHED_CRASHED) and "termination signal" in text:
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg, record.args = ("stopped by a termination signal after the emergency checkpoint: the flow run "
                                       "is rescheduled and resumes from it"), ()
        return True


_RESCHEDULED: list[bool] = []  # this process's train task stopped after an emergency checkpoint
_FINISHED_CRASHED = "Finished in state Crashed("
for _engine in ("prefect.task_runs", "prefect.flow_runs"):
    logging.getLogger(_engine).addFilter(_PreemptionIsNotACrash())


def record_preemption() -> None:
    """Put a preempted train task run in the state it is in: `Preempted` (of type Cancelled:
    nothing failed), with where it stopped and that the rescheduled flow run resumes, instead of
    the Crashed state Prefect's engine gives any task a termination signal stops. Called by the
    flow as the signal unwinds it; best effort (the machine is going away)."""
    if not _PREEMPTED:
        return
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.states import State

    preempted = _PREEMPTED.pop()
    try:
        with get_client(sync_client=True) as client:
            client.set_task_run_state(preempted.task_run_id, State(type=StateType.CANCELLED, name="Preempted",
                                                                   message=preempted.message), force=True)
    except Exception as err:  # noqa: BLE001 - the run resumes either way; only the UI's word is lost
        logging.getLogger(__name__).debug("could not mark the train task run preempted: %s", err)


def _where(saved: list[CheckpointSaved]) -> str:
    if not saved:
        return " before its first checkpoint (nothing saved to resume from)"
    kind = "emergency checkpoint" if saved[0].emergency else "checkpoint"
    return f" at step {saved[0].step}: {kind} written"


@task(name="champion", **retried(timeout_seconds=HOUR))
def find_champion(config: RetrainConfig) -> Champion | None:
    """The root's champion, verified file by file and loaded in the stage child (None: there is
    none); an unusable one says why."""
    from training.pipeline.stage_calls import champion_in_child

    return champion_in_child(config)


@task(name="train", retry_condition_fn=retry_only_preemptions, timeout_seconds=TRAIN_TIMEOUT)
def train_model(config: RetrainConfig, packed: PackResult, prep: PrepResult, champion: Champion | None,
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
        trained = train_stage(config, packed, prep, champion, log_event, champion_val_metric)
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
            _PREEMPTED.append(_Preemption(UUID(str(runtime.task_run.id)), f"preempted{_where(saved)}; the rescheduled "
                                          "flow run resumes from it"))
            _RESCHEDULED.append(True)
        raise
    progress.update(progress.max_steps)  # finished, whether completed or stopped early
    if trained.already_complete:
        logger.info("run %s was already complete: nothing to train", trained.run_key)
    return trained
