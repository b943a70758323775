"""A run's folder as its launcher sees it: whether the run is already done, the attempts ledger,
and where a tuning pause is recorded. Torch-free, as everything in training/launch: the
parent reads these without paying for the training loop's imports.

- A run is finished when its result.json exists (`finished_result`); it is published last, after
  the model package, so a machine that finds it on S3 finds the model too. A tuning trial paused
  at a rung records it in `rungs/step-<n>.json` (`paused_result`).
- The attempts ledger: the launcher counts a process before it starts (`count_attempt`), so one
  killed during start-up is still counted; each process then appends its resume point, the work
  lost and its start-up time (`append_attempt`, fsynced) before it trains. The report's
  preemptions and lost work come from here, never from a checkpoint an attempt may not have
  lived to write.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path

from pydantic import BaseModel, ValidationError

from training.cost.budget import BudgetLimits
from training.errors import StorageError
from training.protocol.job import TrainJob
from training.protocol.results import RungResult, TrainResult
from training.storage.files import read_json
from training.storage.root import StorageRoot

__all__ = ["AttemptRecord", "RUN_FOLDERS", "append_attempt", "count_attempt", "fetch_finished_run",
           "finished_result", "paused_result", "read_attempts", "run_rel", "rung_file", "step_dir_name", "step_of"]

log = logging.getLogger(__name__)


def step_dir_name(step: int) -> str:
    """A checkpoint's folder name under `checkpoints/`."""
    return f"step-{step:08d}"  # zero-padded: sorting by name is sorting by step


def step_of(name: str) -> int | None:
    """The step of a checkpoint folder name (`step_dir_name`'s inverse), or None for other names."""
    prefix, _, digits = name.partition("-")
    return int(digits) if prefix == "step" and digits.isdigit() else None


class AttemptRecord(BaseModel):
    """One line of attempts.jsonl: a process that started training (what it resumed from, what
    the attempt before it lost), a planned pause at a tuning rung (`paused_at`), a stop the
    user asked for (`interrupted_at`: Ctrl-C, not a spot reclaim), or a budget's stop
    (`budget_stopped_at`: a larger budget continues the run, which is no preemption either)."""

    resumed_from: int | None = None
    steps_lost: int = 0
    seconds_lost: float = 0.0
    startup_seconds: float = 0.0
    paused_at: int | None = None
    interrupted_at: int | None = None
    budget_stopped_at: int | None = None

    @property
    def planned_stop(self) -> bool:
        """A stop that was no preemption: a rung, the user's, or a budget's."""
        return self.paused_at is not None or self.interrupted_at is not None or self.budget_stopped_at is not None


def append_attempt(path: Path, entry: AttemptRecord) -> list[AttemptRecord]:
    """Append one attempt's record durably; return every record so far."""
    before = path.read_text() if path.exists() else ""
    torn = bool(before) and not before.endswith("\n")
    line = ("\n" if torn else "") + entry.model_dump_json(exclude_none=True) + "\n"  # never continue a torn line
    with open(path, "a") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())
    entries = []
    for record in (before + line).splitlines():
        try:
            entries.append(AttemptRecord.model_validate_json(record))
        except ValidationError:
            continue  # a line torn by a kill mid-write
    return entries


def read_attempts(run_dir: Path) -> int:
    """Training processes started for this run (counted by the launcher before each start)."""
    try:
        return int((run_dir / "processes-started").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def count_attempt(run_dir: Path) -> int:
    """Count one more training process, before it starts: an attempt killed during start-up
    (imports, data and checkpoint load) is still a preemption the report must show."""
    count = read_attempts(run_dir) + 1
    tmp = run_dir / f".processes-started.tmp-{os.getpid()}"
    tmp.write_text(str(count))
    os.replace(tmp, run_dir / "processes-started")
    return count


# What a run writes into: its folder, its checkpoints, its model package, its tuning rungs.
RUN_FOLDERS = ("checkpoints", "model", "rungs")


def run_rel(run_key: str) -> str:
    return f"runs/{run_key}"


def fetch_finished_run(root: StorageRoot, rel: str) -> bool:
    """Bring down a run that finished on any machine: its result.json (published last) and its
    model package. False when the run has not finished anywhere."""
    if root.fetch(f"{rel}/result.json") is None:
        return False
    for name in ("model.json", "model.pt"):
        root.fetch(f"{rel}/model/{name}")
    return True


def finished_result(job: TrainJob) -> TrainResult | None:
    """The run's result when it already finished (on this machine or, for an s3:// root, any)."""
    if job.config.storage.is_s3 and job.run_rel:
        fetch_finished_run(StorageRoot.from_config(job.config), job.run_rel)
    path = Path(job.run_dir) / "result.json"
    try:
        finished = read_json(path)
        result = None if finished is None else TrainResult.model_validate({**finished, "already_complete": True})
        return None if result is None or _budget_allows_more(job, result) else result
    except (StorageError, ValidationError, TypeError) as err:
        # Derived from the checkpoints, which are verified: set it aside and let training
        # finish the run again from its newest checkpoint (no step is trained twice).
        aside = path.with_name(f"result.json.damaged-{uuid.uuid4().hex[:8]}")
        path.rename(aside) if not path.is_dir() else shutil.rmtree(path)
        log.warning("%s is damaged (%s); set aside as %s, the run is finished again from its checkpoints", path,
                    str(err).splitlines()[0], aside.name)
        return None


def _budget_allows_more(job: TrainJob, result: TrainResult) -> bool:
    """A run its budget stopped is finished only while that budget still holds: run again with a
    larger budget (or none) it trains on from its final checkpoint, as budgets are not part of
    the run key."""
    if result.status != "budget_stopped" or result.steps >= job.max_steps:
        return False
    seconds = result.seconds
    per_step = (seconds.train + seconds.checkpoint) / max(1, result.steps)
    per_eval = seconds.eval / max(1, len(result.history))
    interval = job.config.for_train_rows(1).train.validate_every if result.eval_every is None else result.eval_every
    over = BudgetLimits(job.config.budget, job.rate_per_hour, job.gpus).exceeded(result.billed_seconds, per_step,
                                                                                 per_eval, interval)
    if over is not None:
        return False
    log.info("run %s stopped at its budget at step %d (%s); the budget now allows more: training on from its "
             "checkpoint", job.run_key, result.steps, result.stop_reason)
    return True


def rung_file(step: int) -> str:
    """Where a run paused at a tuning rung records it, relative to the run folder."""
    return f"rungs/step-{step:08d}.json"


def paused_result(job: TrainJob, step: int) -> RungResult | None:
    """The run's pause at `step` when it got there before (here or, for an s3:// root, on any
    machine): a rung is trained once, whatever interrupts the study."""
    rel = f"{job.run_rel}/{rung_file(step)}"
    if job.config.storage.is_s3 and job.run_rel:
        StorageRoot.from_config(job.config).fetch(rel)
    paused = read_json(Path(job.run_dir) / rung_file(step))
    return None if paused is None else RungResult.model_validate(paused)
