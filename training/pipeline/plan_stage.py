"""`retrain plan`: time and cost per candidate instance from a short measured calibration run."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from pydantic import BaseModel

from training.config import RetrainConfig
from training.cost.bill import GB, PlanRow, plan_instances
from training.data.features import FeatureStats
from training.errors import ConfigError
from training.model.memory_fit import training_need
from training.model.network import ModelSchema
from training.pipeline.pack_stage import pack_stage
from training.pipeline.preprocess_stage import preprocess_stage
from training.pipeline.train_stage import run_key_for
from training.storage.root import StorageRoot
from training.trainer.job import TrainJob
from training.trainer.results import TrainResult
from training.trainer.run import train

__all__ = ["Calibration", "PlanReport", "gpu_training_bytes", "plan_run", "refuse_what_does_not_fit"]


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


# Beside the model's own bytes a GPU holds the CUDA context and the caching allocator's slack; an
# allowance, not a measurement (no GPU here): PyTorch's context alone is several hundred MB.
CUDA_OVERHEAD_BYTES = 1.5e9


def gpu_training_bytes(config: RetrainConfig, stats_path: str) -> float | None:
    """What one training process holds on its GPU: the built-in model's weights, gradients,
    AdamW state and activations at its micro-batch (`memory_fit.training_need`), plus the CUDA
    allowance. None for a user factory's model, which is not built twice."""
    if config.model.factory is not None:
        return None
    stats = FeatureStats.from_json(Path(stats_path).read_text())
    _params, need = training_need(config, ModelSchema.of(stats))
    return need + CUDA_OVERHEAD_BYTES


def refuse_what_does_not_fit(rows: list[PlanRow], config: RetrainConfig, need: float | None) -> list[PlanRow]:
    """Each row whose GPU memory (cost.prices' gpu_memory_gb) is below `need`, marked not
    fitting with the reason, and placed after every row that fits."""
    if need is None:
        return rows
    out = []
    for row in rows:
        memory = config.cost.prices[row.instance_type].gpu_memory_gb
        if memory is not None and need > memory * GB:
            row = row.model_copy(update={"fits": False, "refused": (
                f"training needs about {need / GB:.1f} GB a GPU (weights, gradients, AdamW state, activations at "
                f"batch {config.train.batch_size // config.train.world_size}, CUDA context); its GPU has {memory:g} GB")})
        out.append(row)
    return sorted(out, key=lambda r: not r.fits)  # stable: the cost order holds within each group


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
    tc = config.train.for_train_rows(packed.rows["train"])
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
    evals = -(-tc.max_steps // tc.validate_every)
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
    rows = refuse_what_does_not_fit(rows, config, gpu_training_bytes(config, prep.stats_path))
    cheapest = next((r for r in rows if r.meets_deadline and r.fits), None)
    calibration = Calibration(
        steps=steps, seconds_per_step=per_step, seconds_per_validation=per_eval, seconds_per_checkpoint=per_save,
        startup_seconds=startup, data_seconds=data_seconds, estimated_run_hours_here=run_seconds / 3600,
        wall_seconds=time.time() - t1)
    return PlanReport(calibration=calibration, deadline_hours=deadline_hours, rows=rows, cheapest=cheapest)
