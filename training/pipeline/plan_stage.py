"""`retrain plan`: each candidate instance's step time, memory fit, expected hours and cost, from
a short calibration run of the real model on the real data and the GPUs' published figures."""

from __future__ import annotations

import shutil
import time

from pydantic import BaseModel

from training.config import RetrainConfig
from training.cost.planner import DEADLINE_CONFIDENCE, Calibrated, HereFigures, PlanRow, plan_rows, recommended
from training.cost.step_count import StepCosts
from training.errors import ConfigError
from training.launch.process import run_training_process
from training.pipeline.pack_stage import pack_stage
from training.pipeline.preprocess_stage import preprocess_stage
from training.pipeline.step_budget import for_calibration
from training.pipeline.train_stage import run_key_for
from training.protocol.job import TrainJob
from training.protocol.results import TrainResult
from training.registry.step_times import StepTimeBook, family_of, signature_of, store_choice
from training.storage.root import StorageRoot

__all__ = ["Calibration", "PlanReport", "plan_run"]


class Calibration(BaseModel):
    """What the short calibration run measured and counted on this machine."""

    steps: int
    here: HereFigures
    micro_batch: int
    step_costs: StepCosts
    estimated_run_hours_here: float
    wall_seconds: float


class PlanReport(BaseModel):
    """`retrain plan`'s answer: the calibration, every candidate (fitting rows that meet the
    deadline first, cheapest first), the pick and why."""

    calibration: Calibration
    calibrated: Calibrated
    deadline_hours: float | None
    rows: list[PlanRow]
    cheapest: PlanRow | None
    why: str


def _calibrate(config: RetrainConfig, steps: int, dataset_dir: str, stats_path: str, fingerprint: str) -> TrainResult:
    """The real loop on the real data and model for a few steps in a scratch folder (local
    even for an s3:// root: its output is thrown away), counting one step's cost at the end. It
    runs in a training child, as a run does: the plan's own process never imports torch."""
    calib = for_calibration(config, steps)
    # The workers probe times one core loading a batch: the host limit of every candidate.
    calib.train.loader.num_workers = "auto"
    scratch = StorageRoot.from_config(config).local / "plan" / run_key_for(calib, fingerprint)
    shutil.rmtree(scratch, ignore_errors=True)
    result = run_training_process(TrainJob(run_key="plan", run_dir=str(scratch), dataset_dir=dataset_dir,
                                           stats_path=stats_path, config=calib, count_variants=True))
    shutil.rmtree(scratch, ignore_errors=True)
    if result.step_costs is None:
        raise ConfigError("retrain plan could not count a step of this model (the training log says why), so it "
                          "cannot predict GPU step times; set measured_step_seconds or relative_speed on each "
                          "cost.prices entry to plan from measurements")
    return result


def _why(best: PlanRow | None, rows: list[PlanRow], deadline: float | None) -> str:
    if best is None and rows and all(r.here for r in rows):
        return "no instance to rent among the candidates: this machine is shown for comparison, never recommended"
    if best is None:
        return ("no candidate fits and ends by the deadline with "
                f"{DEADLINE_CONFIDENCE:.0%} probability" if deadline is not None else "no candidate fits")
    beaten = [r for r in rows if r is not best and r.fits and r.meets_deadline and not r.here]
    text = (f"{best.instance_type} ({best.market}, {best.variant}): expected ${best.cost_usd[1]:.4f} "
            f"in {best.hours[1]:.3f} h")
    if best.p_deadline is not None:
        text += f", {best.p_deadline:.0%} likely to end within {deadline:g} h"
    if beaten:
        text += f"; the next, {beaten[0].instance_type} ({beaten[0].market}), expects ${beaten[0].cost_usd[1]:.4f}"
    slower_cheaper_rate = [r for r in rows if r.fits and r.rate_per_hour < best.rate_per_hour and not r.meets_deadline
                           and not r.here]
    if slower_cheaper_rate:
        r = slower_cheaper_rate[0]
        text += f"; {r.instance_type} ({r.market}) has a lower rate but misses the deadline"
    return text


def plan_run(config: RetrainConfig, instance_types: list[str], deadline_hours: float | None,
             calibration_steps: int = 50) -> PlanReport:
    unknown = [t for t in instance_types if t not in config.cost.prices]
    if unknown:
        raise ConfigError(f"--instance-types: no price for {unknown} in cost.prices (known: {sorted(config.cost.prices)})")
    t0 = time.perf_counter()
    packed = pack_stage(config)
    prep = preprocess_stage(packed.dataset_dir, config.preprocess, config.storage, config.cost.tags)
    data_seconds = time.perf_counter() - t0
    tc = config.train.for_train_rows(packed.train_rows)
    steps = min(calibration_steps, tc.max_steps)
    t1 = time.time()
    result = _calibrate(config, steps, packed.dataset_dir, prep.stats_path, packed.fingerprint)
    assert result.step_costs is not None and result.batch_layout is not None
    seconds = result.seconds
    probe = result.num_workers.probe if result.num_workers is not None else None
    # The steady step (warm-up left out), and the warm-up's extra seconds paid once, as start-up.
    per_step = result.steady_step_seconds or seconds.train / steps
    warm_up = max(0.0, seconds.train - per_step * steps)
    here = HereFigures(
        steps=tc.max_steps, evals=-(-tc.max_steps // tc.validate_every), seconds_per_step=per_step,
        seconds_per_validation=seconds.eval, seconds_per_checkpoint=seconds.checkpoint,
        startup_seconds=seconds.startup + warm_up, data_seconds=data_seconds,
        load_seconds_per_batch=probe.data_seconds_per_batch if probe is not None else None,
        cpu_scaling=result.cpu_scaling)
    micro_batch = result.batch_layout.micro_batch
    book = StepTimeBook.load(StorageRoot.from_config(config))
    calibrated = book.calibration(family_of(config), signature_of(result.step_costs.as_run))
    rows = plan_rows(config, instance_types, result.step_costs, micro_batch, here, deadline_hours, calibrated)
    cheapest = recommended(rows)
    if cheapest is not None:
        store_choice(config, cheapest)  # what `cost.instance_type: auto` runs take
    here_hours = (here.data_seconds + here.startup_seconds + here.seconds_per_step * here.steps
                  + here.evals * here.seconds_per_validation) / 3600
    calibration = Calibration(steps=steps, here=here, micro_batch=micro_batch, step_costs=result.step_costs,
                              estimated_run_hours_here=here_hours, wall_seconds=time.time() - t1)
    return PlanReport(calibration=calibration, calibrated=calibrated, deadline_hours=deadline_hours, rows=rows, cheapest=cheapest,
                      why=_why(cheapest, rows, deadline_hours))
