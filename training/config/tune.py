"""`tune` and `tracking`: the budgeted search, and MLflow tracking and registry."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, field_validator

from training.config.marks import COMPUTED, OPERATIONAL
from training.config.section import _Section

__all__ = ["MAX_TUNE_SEEDS", "TrackingConfig", "TuneConfig"]

MAX_TUNE_SEEDS = 4  # tune.seeds' largest value: the journal gate refuses a seed record beyond it


class TuneConfig(_Section):
    """`retrain tune`: a budgeted search over model.* and train.* keys (ignored by `retrain run`)."""

    space: dict[str, str] = Field(
        {}, description='Search space: dotted model.* or train.* key -> "loguniform(1e-4, 1e-2)", '
        '"uniform(0, 0.5)", "int(1, 4)", "logint(16, 256)" or "choice([a, b])".', json_schema_extra=COMPUTED)
    max_trials: int = Field(20, ge=1, le=10_000, description="Trials at most (an interrupted trial resumed is "
                            "the same trial).", json_schema_extra=OPERATIONAL)
    sampler: Literal["tpe", "random"] = Field("tpe", description="Optuna sampler: TPE (the first 10 trials are "
                                              "random), or random search.", json_schema_extra=COMPUTED)
    pruner: Literal["asha", "optuna_sh", "none"] = Field(
        "asha", description="asha: asynchronous successive halving over optimizer steps as Li et al. define it (a "
        "trial waits at its rung until it is in the top 1/reduction_factor of the trials that reached it); "
        "optuna_sh: Optuna's SuccessiveHalvingPruner (decides as a trial reports; the first trials of a rung go on "
        "unconditionally); none: every trial trains to train.max_steps.", json_schema_extra=COMPUTED)
    min_resource: int | None = Field(
        None, gt=0, description="Optimizer steps of the first rung; rungs are min_resource x reduction_factor^k, "
        "then train.max_steps. A multiple of train.eval_every. Empty: a fifth of train.max_steps, rounded down to a "
        "multiple of train.eval_every: an earlier first rung ranks trials on curves that later cross, and prunes "
        "the ones that would have won (`python -m benchmarks.run tuning_replay` measures the schedules).",
        json_schema_extra=COMPUTED)
    reduction_factor: int = Field(2, ge=2, le=16, description="Keep the top 1/reduction_factor of trials at each "
                                  "rung.", json_schema_extra=COMPUTED)
    seed: int = Field(0, description="Seed of the sampler: the same seed and space give the same trials.",
                      json_schema_extra=COMPUTED)
    concurrency: int = Field(1, ge=1, le=256, description="Trials (Prefect task runs) at once on the flow's task "
                             "runner.", json_schema_extra=OPERATIONAL)
    max_usd: float | None = Field(None, gt=0, description="Study budget in $: every trial's billed machine time "
                                  "(restarts and work lost to preemption included), the setup and the calibration.",
                                  json_schema_extra=OPERATIONAL)
    max_gpu_hours: float | None = Field(None, gt=0, description="Study budget in GPU-hours, counted the same way.",
                                        json_schema_extra=OPERATIONAL)
    max_wall_seconds: float | None = Field(None, gt=0, description="Study budget in machine seconds, counted the "
                                           "same way.", json_schema_extra=OPERATIONAL)
    calibration_steps: int = Field(20, ge=1, description="Steps of the measured calibration run that prices the "
                                   "first rung before any trial starts.", json_schema_extra=OPERATIONAL)
    promote: bool = Field(True, description="Put the study's answer through the champion/challenger gate on the "
                          "test split, as a run of its config would be. In a root with no champion yet, the config as "
                          "given goes through first, so an answer that differs from it is promoted only if it beats "
                          "it on test by the paired interval. false: the study only reports.",
                          json_schema_extra=OPERATIONAL)
    seeds: int | Literal["auto"] = Field(
        "auto", description="Extra seeds (train.seed + 1, + 2, ...) the config as given and the two best other "
        "trials are retrained with once the trials are done; the answer is then the best mean over seeds. On a "
        "small table one validation split is noisy and one seed's luck picks the trial. auto: 2 below 10,000 "
        "training rows, else 0. The study's budget keeps back what they cost.", json_schema_extra=OPERATIONAL)

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, v: int | str) -> int | str:
        if isinstance(v, int) and not 0 <= v <= MAX_TUNE_SEEDS:
            raise ValueError(f'must be 0 to {MAX_TUNE_SEEDS} or "auto"')
        return v

class TrackingConfig(_Section):
    mlflow_uri: str | None = Field(
        None, description="MLflow tracking server (http://host:5000) or sqlite:///file.db; empty: MLFLOW_TRACKING_URI, "
        "and with neither nothing is recorded. Needs pip install '.[mlflow]'.", json_schema_extra=OPERATIONAL
    )
    experiment: str = Field("retrain", min_length=1, description="MLflow experiment of the runs.", json_schema_extra=OPERATIONAL)
    registered_model: str = Field(
        "retrain-model", min_length=1, description="Registered model the promoted packages are versions of; the aliases "
        "`challenger` (every new version) and `champion` (moved with models/champion) live on it.", json_schema_extra=OPERATIONAL
    )
    timeout_seconds: float = Field(
        5.0, gt=0, description="Per request to MLflow: a server that does not answer in time is skipped for the rest of "
        "the stage, and the report says what was not recorded.", json_schema_extra=OPERATIONAL
    )

    def uri(self) -> str | None:
        return self.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI") or None
