"""`retrain plan`: time and cost per candidate instance from a short measured calibration run."""

from __future__ import annotations

import shutil
import time

from pydantic import BaseModel

from training.config import RetrainConfig
from training.cost.bill import PlanRow, plan_instances
from training.errors import ConfigError
from training.pipeline.pack_stage import pack_stage
from training.pipeline.preprocess_stage import preprocess_stage
from training.pipeline.train_stage import run_key_for
from training.storage.root import StorageRoot
from training.trainer.job import TrainJob
from training.trainer.results import TrainResult
from training.trainer.run import train

__all__ = ["Calibration", "PlanReport", "plan_run"]


class Calibration(BaseModel):
    """What the short calibration run measured on this machine."""

    steps: int
    seconds_per_step: float
    seconds_per_validation: float
    seconds_per_checkpoint: float
    startup_seconds: float
    data_seconds: float
    estimated_run_hours_here: float
    wall_seconds: float


class PlanReport(BaseModel):
    """`retrain plan`'s answer: the calibration, every candidate cheapest first, the pick."""

    calibration: Calibration
    deadline_hours: float | None
    rows: list[PlanRow]
    cheapest: PlanRow | None


def plan_run(config: RetrainConfig, instance_types: list[str], deadline_hours: float | None,
             calibration_steps: int = 50) -> PlanReport:
    unknown = [t for t in instance_types if t not in config.cost.prices]
    if unknown:
        raise ConfigError(f"--instance-types: no price for {unknown} in cost.prices (known: {sorted(config.cost.prices)})")
    t0 = time.perf_counter()
    packed = pack_stage(config)
    prep = preprocess_stage(packed.dataset_dir, config.preprocess.model_dump(mode="json"), config.storage.root,
                            config.storage.model_dump(mode="json"), config.cost.tags)
    data_seconds = time.perf_counter() - t0

    # Calibrate: the real loop, on the real data and model, for a few steps in a scratch folder.
    tc = config.train
    steps = min(calibration_steps, tc.max_steps)
    calib = config.model_copy(deep=True)
    calib.train.max_steps = steps
    calib.train.eval_every = steps
    calib.train.checkpoint.every = steps
    calib.train.patience = 0
    # Local even for an s3:// root: calibration output is thrown away.
    scratch = StorageRoot.from_config(config).local / "plan" / run_key_for(calib, packed.fingerprint)
    shutil.rmtree(scratch, ignore_errors=True)
    t1 = time.time()
    result = train(TrainJob(run_key="plan", run_dir=str(scratch), dataset_dir=packed.dataset_dir,
                            stats_path=prep.stats_path, config=calib))
    shutil.rmtree(scratch, ignore_errors=True)
    assert isinstance(result, TrainResult)  # one process (rank 0), no pause
    seconds = result.seconds
    per_step = seconds.train / steps
    per_eval = seconds.eval  # one validation pass
    per_save = seconds.checkpoint
    evals = -(-tc.max_steps // tc.eval_every)
    mode, value = tc.checkpoint.interval()
    interval_s = per_step * value if mode == "steps" else value if mode == "seconds" else (
        (2 * max(per_save, 1e-3) * tc.checkpoint.mean_seconds_between_preemptions) ** 0.5)
    saves = tc.max_steps * per_step / max(interval_s, 1e-9)
    startup = seconds.startup
    run_seconds = data_seconds + startup + per_step * tc.max_steps + per_eval * evals + per_save * saves
    candidates = []
    for name in instance_types:
        price = config.cost.prices[name]
        candidates.append((name, "on_demand", price.on_demand_per_hour, price.relative_speed))
        if price.spot_per_hour is not None:
            candidates.append((name, "spot", price.spot_per_hour, price.relative_speed))
    rows = plan_instances(
        calibrated_hours=run_seconds / 3600,
        candidates=candidates,
        mean_hours_between_preemptions=tc.checkpoint.mean_seconds_between_preemptions / 3600,
        restart_hours=startup / 3600,
        checkpoint_interval_hours=interval_s / 3600,
        deadline_hours=deadline_hours,
    )
    cheapest = next((r for r in rows if r.meets_deadline), None)
    calibration = Calibration(
        steps=steps, seconds_per_step=per_step, seconds_per_validation=per_eval, seconds_per_checkpoint=per_save,
        startup_seconds=startup, data_seconds=data_seconds, estimated_run_hours_here=run_seconds / 3600,
        wall_seconds=time.time() - t1)
    return PlanReport(calibration=calibration, deadline_hours=deadline_hours, rows=rows, cheapest=cheapest)
