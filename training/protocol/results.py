"""What training hands back: a finished run (`result.json`, `TrainResult`), a tuning trial
paused at a rung (`RungResult`), and the typed parts of both, the seconds and validations they
count. Torch-free: the launcher, the flow and the CLI read them. Reading one back tolerates keys a
newer or older version wrote (`extra="ignore"`), so a finished run stays finished across
upgrades; validations keep the flat JSON form (`val_<metric>` keys) result.json always had.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, PlainSerializer, model_validator

from training.cost.cpu_step import CpuScaling
from training.cost.step_count import StepCosts, StepCount
from training.cost.utilization import AcceleratorStats
from training.model.model_ref import ModelRef
from training.protocol.record import Record
from training.protocol.threads import ThreadPolicy

__all__ = ["AutoBatch", "BatchLayout", "ChampionCheck", "CheckpointInterval", "CheckpointUpload", "LoaderWorkers", "StepMode",
           "ProfileSummary", "RungResult", "Seconds", "TopOp", "TrainResult", "Validation", "WarmStart", "WorkersProbe"]


class Seconds(BaseModel):
    """Where a run's machine time went, accumulated across its attempts."""

    model_config = ConfigDict(extra="ignore", validate_assignment=False)

    train: float = 0.0  # the optimizer steps' wall time, of which:
    data_wait: float = 0.0  # ... waiting for a batch
    compute: float = 0.0  # ... forward and backward
    checkpoint: float = 0.0  # the loop's stalls for checkpoints
    eval: float = 0.0  # validation passes
    lost: float = 0.0  # training past the last checkpoint, lost to preemptions
    startup: float = 0.0  # every training process's start-up to its first step
    pre_train: float = 0.0  # pack and preprocess, counted once per run

    def billed(self) -> float:
        """Every second the machine was held for this run, lost work and restarts included."""
        return self.pre_train + self.startup + self.train + self.eval + self.checkpoint + self.lost


class Validation(BaseModel):
    """One validation: the step, the last batch's training loss, the learning rate, and every
    metric of the task on the validation split."""

    model_config = ConfigDict(frozen=True)

    step: int
    train_loss: float
    lr: float = 0.0
    metrics: dict[str, float]

    def __getitem__(self, metric: str) -> float:
        return self.metrics[metric]

    def logged_metrics(self) -> dict[str, float]:
        """What MLflow records of it, by the names it has there: train_loss, val_<metric>."""
        return {"train_loss": self.train_loss, **{f"val_{name}": value for name, value in self.metrics.items()}}

    def to_json(self) -> dict[str, float]:
        """The flat form of result.json and checkpoints: step, train_loss, val_<metric>..., lr."""
        return {"step": self.step, "train_loss": self.train_loss,
                **{f"val_{name}": value for name, value in self.metrics.items()}, "lr": self.lr}

    @classmethod
    def from_json(cls, flat: dict[str, Any]) -> Validation:
        metrics = {key[4:]: float(value) for key, value in flat.items() if key.startswith("val_")}
        return cls(step=int(flat["step"]), train_loss=float(flat["train_loss"]), lr=float(flat.get("lr", 0.0)),
                   metrics=metrics)


def validations(history: Any) -> Any:
    """A history read back from JSON (flat dicts) as Validations."""
    if isinstance(history, list):
        return [Validation.from_json(h) if isinstance(h, dict) and "metrics" not in h else h for h in history]
    return history


# A run's validations: Validation models in Python, the flat dicts of result.json and
# report.json in JSON (read back from either form).
History = Annotated[list[Validation], BeforeValidator(validations),
                    PlainSerializer(lambda history: [v.to_json() for v in history])]


class WarmStart(Record):
    requested: bool
    used: bool
    reason: str
    champion_sha256: str | None = None


class WorkersProbe(Record):
    """What `train.loader.num_workers: auto` measured, and the workers it chose."""

    num_workers: int
    stall_without_workers: float
    data_seconds_per_batch: float
    compute_seconds_per_batch: float
    spare_cpus: int
    worker_seconds_per_batch: float | None


class LoaderWorkers(Record):
    """The DataLoader workers a run used, and the probe behind "auto" (None when set by hand)."""

    used: int = 0
    probe: WorkersProbe | None = None
    resident: bool = False  # the train split held on the device, batches gathered there (train.loader.resident)


class StepMode(Record):
    """How the run's steps ran (train.step, train.steps_per_block)."""

    step: str = "eager"  # eager, capturable (the capturable step run as it is), graph (captured, replayed)
    reason: str | None = None  # why not graph, where graph was asked for or auto
    steps_per_block: int = 1  # at the end of the run
    boundary_seconds: float | None = None  # a block's host work, averaged


class AutoBatch(Record):
    """`train.auto_batch_size`'s memory search: what it found, or why it was skipped."""

    skipped: str | None = None  # why no search ran (no accelerator memory to fit on this device)
    micro_batch_per_process: int | None = None
    grad_accum: int | None = None
    max_fitting: int | None = None  # the largest micro-batch that fit the budget
    budget_bytes: int | None = None
    probes: list[tuple[int, int, bool]] = []  # (rows, peak bytes, fits), in the order tried
    seconds: float | None = None


class BatchLayout(Record):
    """The micro-batch and accumulation a run used; `auto` is the memory search behind them."""

    micro_batch: int
    grad_accum: int
    auto: AutoBatch | None
    peak_lr: float


class TopOp(Record):
    """One operator of torch.profiler's table, by its own CPU time."""

    name: str
    calls: int
    self_cpu_ms: float
    cpu_total_ms: float


class ProfileSummary(Record):
    """`train.profile`: where the Chrome trace was written, the steps it covers, and the top
    operators by their own CPU time."""

    trace: str
    steps: int
    after_steps: int
    top_ops: list[TopOp]


class CheckpointInterval(Record):
    """The checkpoint schedule as it ran: every `steps`, every `seconds` of training, or the
    Young/Daly optimum (`auto`) from the measured save cost and the mean time between preemptions."""

    mode: str  # steps, seconds or auto
    steps: int | None = None
    seconds: float | None = None
    save_cost_seconds: float | None = None
    mean_seconds_between_preemptions: float | None = None


class CheckpointUpload(Record):
    """Checkpoints uploaded to an s3:// root in the background, behind the local ones."""

    uploaded: int
    superseded: int  # skipped: a newer checkpoint was ready before their turn
    failures: int
    background_seconds: float


class ChampionCheck(Record):
    """The champion as verified before training: its sha256, and what is wrong with it, if anything."""

    sha256: str
    problem: str | None = None


class TrainResult(Record):
    """A finished training run (`result.json`), plus what the train stage adds around it."""

    run_key: str
    status: str  # completed, budget_stopped or early_stopped
    stop_reason: str | None = None
    steps: int
    max_steps: int
    eval_every: int | None = None  # train.eval_every as used (auto resolved for the train split)
    patience: int | None = None  # train.patience as used, in validations
    best_step: int
    best_val_auc: float | None  # binary runs judged on auc; None otherwise (see metric, best_val_metric)
    metric: str = "auc"  # eval.metric of the run
    best_val_metric: float | None = None
    precision: str
    device: str
    model: ModelRef
    history: History
    resumed_from_steps: list[int]
    preemptions: int
    steps_lost: int
    seconds: Seconds
    steady_step_seconds: float | None = None  # per step after warm-up, this attempt (Trainer.steady_step_seconds)
    billed_seconds: float
    fp32_slowdown: float | None = 1.0  # fp32 step time over this run's; None: not measured (train.measure_fp32)
    profile: ProfileSummary | None = None
    accelerator: AcceleratorStats
    first_step_latency_seconds: float | None = None
    restart_to_first_step_seconds: list[float] = []
    checkpoints_saved: int = 0
    checkpoint_background_seconds: float = 0.0
    checkpoint_interval: CheckpointInterval | None = None
    step_count: StepCount | None = None  # one step as a GPU would run it (training.trainer.step_cost)
    step_costs: StepCosts | None = None  # ... and its memory-saving variants, when the job asked (plan)
    cpu_scaling: CpuScaling | None = None  # ... and, on a CPU, its one-thread against many-thread time (plan)
    samples_seen: int = 0
    batch_layout: BatchLayout | None = None
    num_workers: LoaderWorkers = LoaderWorkers()
    threads: ThreadPolicy | None = None  # result.json written before the thread policy: None
    compile_seconds: float | None = None
    step_mode: StepMode = StepMode()
    world_size: int = 1
    checkpoint_upload: CheckpointUpload | None = None
    # Added by the train stage (not in result.json).
    already_complete: bool = False
    run_dir: str = ""
    run_uri: str = ""
    seconds_this_attempt: float = 0.0
    warm_start: WarmStart | None = None
    champion_check: ChampionCheck | None = None
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
        return next((v.step for v in self.history
                     if (v[self.metric] >= target if higher_is_better else v[self.metric] <= target)), None)


class RungResult(Record):
    """Where a tuning trial's run stands after training towards a rung: paused there
    (`runs/<key>/rungs/step-<n>.json`, written by the training process with its checkpoint), or
    finished (completed, early_stopped, budget_stopped; from its result.json)."""

    run_key: str
    status: str  # paused, completed, early_stopped or budget_stopped
    step: int
    metric: str
    value: float  # the best validation metric so far: what the model kept at this step scores
    # A finished run's last validation: what a study ranks finished trials by, since `value` is
    # the best of many validations on the rows the ranking reads (None: paused, or no history).
    last_value: float | None = None
    billed_seconds: float  # the run's, restarts and lost work included
    steps_lost: int = 0
    preemptions: int = 0
    startup_seconds: float = 0.0  # the run's process start-ups so far

    @classmethod
    def of(cls, result: TrainResult) -> RungResult:
        assert result.best_val_metric is not None  # a finished run validated at least once
        last = result.history[-1].metrics.get(result.metric) if result.history else None
        return cls(run_key=result.run_key, status=result.status, step=result.steps, metric=result.metric,
                   value=result.best_val_metric, last_value=last, billed_seconds=result.billed_seconds,
                   steps_lost=result.steps_lost, preemptions=result.preemptions,
                   startup_seconds=result.seconds.startup)
