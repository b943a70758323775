"""What each stage hands to the next: typed, frozen, JSON-serialisable results.

Prefect stores and caches them (pydantic models pickle and hash like plain values); tasks, the
report and the artifacts read their attributes. Torch-free: the flow and the CLI import them.
`result.json` of a run is `TrainResult.to_json()`, and reading one back tolerates keys a newer
or older version wrote (`extra="ignore"`), so a finished run stays finished across upgrades.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

from training.trainer.threads import ThreadPolicy

__all__ = ["Evaluation", "LaunchPhases", "ModelRef", "PackResult", "PredictResult", "PrepResult", "Promotion", "RungResult", "TrainResult", "WarmStart"]


class _Result(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class LaunchPhases(_Result):
    """What `retrain run` spent before the flow's first stage, handed to the report through the
    environment (`ENV`): the flow runs in the CLI's process, but a deployed run has none."""

    ENV: ClassVar[str] = "RETRAIN_LAUNCH_PHASES"

    config_seconds: float  # arguments and the config file
    imports_seconds: float  # Prefect and the pipeline's modules
    server_seconds: float  # the temporary Prefect server's start-up (0 when one was running)
    flow_called_at: float  # epoch seconds when the flow was called


class PackResult(_Result):
    """The packed dataset: where it is, what it holds, and whether this run packed it."""

    source: str
    dataset_dir: str
    dataset_uri: str
    fingerprint: str
    rows: dict[str, int]
    shards: int
    reused: bool
    uploaded_bytes: int
    storage: dict[str, Any]
    bayes_auc: float | None = None  # the demo generator's Bayes-optimal AUC (demo data only)
    started_at: float  # epoch seconds when the pipeline's first stage began
    seconds: float
    parts: int | None = None  # pack parts this run packed (None: reused)


class PrepResult(_Result):
    """The fitted (or reused) feature statistics of a dataset."""

    stats_path: str
    stats_rel: str  # relative to storage.root: where they are on S3
    reused: bool
    key: str
    code_version: int
    cardinalities: list[int]
    seconds: float


class ModelRef(_Result):
    """An exported model package and the two hashes that pin it."""

    uri: str
    sha256: str
    meta_sha256: str


class WarmStart(_Result):
    requested: bool
    used: bool
    reason: str
    champion_sha256: str | None = None


class TrainResult(_Result):
    """A finished training run (`result.json`), plus what the train stage adds around it."""

    run_key: str
    status: str  # completed, budget_stopped or early_stopped
    stop_reason: str | None = None
    steps: int
    max_steps: int
    best_step: int
    best_val_auc: float | None  # binary runs judged on auc; None otherwise (see metric, best_val_metric)
    metric: str = "auc"  # eval.metric of the run
    best_val_metric: float | None = None
    precision: str
    device: str
    model: ModelRef
    history: list[dict[str, float]]
    resumed_from_steps: list[int]
    preemptions: int
    steps_lost: int
    seconds: dict[str, float]
    billed_seconds: float
    fp32_slowdown: float = 1.0
    profile: dict[str, Any] | None = None
    accelerator: dict[str, Any]
    first_step_latency_seconds: float | None = None
    restart_to_first_step_seconds: list[float] = []
    checkpoints_saved: int = 0
    checkpoint_background_seconds: float = 0.0
    checkpoint_interval: dict[str, Any] | None = None
    samples_seen: int = 0
    batch_layout: dict[str, Any] = {}
    num_workers: dict[str, Any] = {}
    threads: ThreadPolicy | None = None  # result.json written before the thread policy: None
    compile_seconds: float | None = None
    world_size: int = 1
    checkpoint_upload: dict[str, Any] | None = None
    # Added by the train stage (not in result.json).
    already_complete: bool = False
    run_dir: str = ""
    run_uri: str = ""
    seconds_this_attempt: float = 0.0
    warm_start: WarmStart | None = None
    champion_check: dict[str, Any] | None = None
    steps_to_target: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _metric_of_old_results(cls, data: Any) -> Any:
        """result.json written before eval.metric: a binary run judged on AUC."""
        if isinstance(data, dict) and data.get("best_val_metric") is None and "metric" not in data:
            data = {**data, "best_val_metric": data.get("best_val_auc")}
        return data

    def steps_to(self, target: float | None, higher_is_better: bool = True) -> int | None:
        """The first validated step whose validation metric reached `target`."""
        if target is None:
            return None
        key = f"val_{self.metric}"
        return next((int(h["step"]) for h in self.history
                     if (h[key] >= target if higher_is_better else h[key] <= target)), None)


class RungResult(_Result):
    """Where a tuning trial's run stands after training towards a rung: paused there
    (`runs/<key>/rungs/step-<n>.json`, written by the training process with its checkpoint), or
    finished (completed, early_stopped, budget_stopped; from its result.json)."""

    run_key: str
    status: str  # paused, completed, early_stopped or budget_stopped
    step: int
    metric: str
    value: float  # the best validation metric so far: what the model kept at this step scores
    billed_seconds: float  # the run's, restarts and lost work included
    steps_lost: int = 0
    preemptions: int = 0
    startup_seconds: float = 0.0  # the run's process start-ups so far

    @classmethod
    def of(cls, result: TrainResult) -> RungResult:
        assert result.best_val_metric is not None  # a finished run validated at least once
        return cls(run_key=result.run_key, status=result.status, step=result.steps, metric=result.metric,
                   value=result.best_val_metric, billed_seconds=result.billed_seconds,
                   steps_lost=result.steps_lost, preemptions=result.preemptions,
                   startup_seconds=result.seconds.get("startup", 0.0))


class Promotion(_Result):
    promoted: bool
    reason: str
    challenger_sha256: str
    champion_sha256: str | None = None
    champion_metrics: dict[str, Any] | None = None
    champion_note: str | None = None
    champion_problem: str | None = None


class Evaluation(_Result):
    """The challenger's test metrics and the promotion decision (`evaluation.json`)."""

    tags: dict[str, str]
    metrics: dict[str, float]
    task: str = "binary"
    metric: str = "auc"  # the one promotion judged (eval.metric)
    target: float | None = None  # eval.target (or the old eval.target_auc)
    target_auc: float | None = None  # the same target under its old name, binary auc runs only
    target_met: bool | None = None
    promotion: Promotion
    seconds: float


class PredictResult(_Result):
    """What `retrain predict` wrote (or found already written)."""

    output: str
    rows: int
    model_sha256: str
    skipped: bool  # the output already held this model's scores of this input
    seconds: float
    key_columns: list[str]  # not `keys`: Prefect treats a model with .keys() as a mapping
