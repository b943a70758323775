"""A trial's unit of work, and the calibration that prices it.

`rung_stage` trains a trial's run towards a rung in a child process, exactly as `train_stage`
trains a run (same job, same run key, same resumable child), but pausing at the rung. It is
idempotent: a rung the run already reached (its `rungs/step-<n>.json`) or a run that finished
is answered from disk without starting anything.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field

from training.config import RetrainConfig, TuneConfig
from training.launch.child import WarmPool
from training.launch.process import log_child_event, run_rung_process, run_training_process
from training.pipeline.handoffs import PackResult, PrepResult
from training.pipeline.step_budget import for_calibration
from training.pipeline.train_stage import build_train_job
from training.protocol.events import ChildEvent
from training.protocol.results import RungResult
from training.protocol.runs import finished_result, paused_result
from training.storage.root import StorageRoot
from training.tune.study import STUDY_DIR, RungCost
from training.copies import updated

log = logging.getLogger(__name__)

__all__ = ["Calibration", "calibrate", "rung_stage", "TRIAL_CHILDREN"]

# The study's training children, kept warm between rungs and trials (see training.launch.child): in
# this process, sized to tune.concurrency and closed by the driver when the study ends.
TRIAL_CHILDREN = WarmPool()


def rung_stage(config: RetrainConfig, packed: PackResult, prep: PrepResult, step: int,
               on_event: Callable[[ChildEvent], None] = log_child_event) -> RungResult:
    """Train the trial's run until `step` (a rung: paused there) or its end."""
    from training.pipeline.stage_calls import champion_in_child

    champion = champion_in_child(config) if config.train.init_from == "champion" else None  # torch: in the child
    job, _ = build_train_job(config, packed, prep, champion)
    job.pre_train_seconds = 0.0  # the trials share one pack and one preprocessing: the study counts them once
    finished = finished_result(job)
    if finished is not None:
        return RungResult.of(finished)
    if step >= config.train.max_steps:
        return RungResult.of(run_training_process(job, on_event, pool=TRIAL_CHILDREN))
    paused = paused_result(job, step)
    if paused is not None:
        return paused
    job.pause_at = step
    return run_rung_process(job, on_event, pool=TRIAL_CHILDREN)


# What a calibration can have measured: no calibration runs for ten years or a trillion steps.
_SECONDS = Field(ge=0, le=10 * 366 * 86_400, allow_inf_nan=False)


class Calibration(BaseModel):
    """calibration.json: the short run that prices every rung until real rungs are measured.
    Input from whoever can write the root: only its own keys, each in its range, and its steps
    those of the study's calibration (`read_calibration`); otherwise it is measured again."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    steps: int = Field(ge=1, le=10**12, strict=True)
    billed_seconds: float = _SECONDS  # what the calibration itself cost
    startup_seconds: float = _SECONDS
    seconds_per_step: float = Field(ge=1e-6, le=86_400, allow_inf_nan=False)  # no step takes under a microsecond
    device: str | None = Field(None, pattern=r"^[a-z]{1,16}$")  # where it trained (None: a calibration.json written before this was kept)

    @property
    def cost(self) -> RungCost:
        return RungCost(self.startup_seconds, self.seconds_per_step)


def calibrate(config: RetrainConfig, packed: PackResult, prep: PrepResult, study: str,
              on_event: Callable[[ChildEvent], None] = log_child_event) -> Calibration:
    """Train the base config for tune.calibration_steps in a fresh child process, in a scratch
    run folder that is removed afterwards: the measured start-up and seconds per step price
    every rung until real rungs have been measured."""
    steps = min(config.tune.calibration_steps, config.train.max_steps)
    calib = for_calibration(updated(config, {"tune": TuneConfig()}), steps)  # its rungs would not fit
    calib.budget.max_wall_seconds = None
    job, _ = build_train_job(calib, packed, prep, None)
    scratch = StorageRoot.from_config(config).local / STUDY_DIR / study / "calibration"
    shutil.rmtree(scratch, ignore_errors=True)
    job.run_dir, job.run_rel, job.pre_train_seconds = str(scratch), "", 0.0  # local only: thrown away
    try:
        result = run_training_process(job, on_event, pool=TRIAL_CHILDREN)  # its child trains the first rung
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    s = result.seconds
    # A rung pays the checkpoint and validation at its end, as the calibration did.
    per_step = (s.train + s.eval + s.checkpoint) / steps
    return Calibration(steps=steps, billed_seconds=result.billed_seconds, startup_seconds=s.startup,
                       seconds_per_step=per_step, device=result.device)


def read_calibration(path: Path, steps: int | None = None) -> Calibration | None:
    """The stored calibration, when it is one this study's calibration writes (`steps`: its
    step count); else None, and it is measured again (with a warning when a file was there)."""
    try:
        found = Calibration.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:  # ValueError: pydantic's ValidationError too
        log.warning("%s is not a calibration this study writes (%s): calibrating again", path,
                    str(err).splitlines()[0])
        return None
    if steps is not None and found.steps != steps:
        log.warning("%s is of %d steps, not this study's %d: calibrating again", path, found.steps, steps)
        return None
    return found
