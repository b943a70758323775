"""`report.json`: what a run did, cost and decided, as one typed model.

The report stage builds a `RunReport` and writes it; everything that reads a report (the CLI's
summary, `report.md`, the Prefect artifacts, the unchanged-rerun shortcut) reads it back through
`RunReport.read`, never by string keys. Its JSON keys are a contract: they are only ever added
to, and a report written by an earlier version reads back (missing keys take their defaults,
unknown ones are ignored).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from training.cost.bill import ComputeCost, CostReport
from training.cost.utilization import Utilization
from training.errors import StorageError
from training.model.model_ref import ModelRef
from training.pipeline.handoffs import Promotion, TrainingDecision
from training.protocol.results import CheckpointInterval, History, LoaderWorkers, ProfileSummary, Seconds, WarmStart
from training.protocol.threads import ThreadPolicy
from training.registry.step_times import StepTime
from training.registry.tracking import TrackingNotes
from training.storage.root import StorageSummary

__all__ = ["KeptReport", "Phases", "PreemptionSummary", "ReportFiles", "RunReport", "StageSummaries", "read_report"]


class _Part(BaseModel):
    # Not frozen, unlike protocol.record.Record: the report stage fills a report in as it goes.
    model_config = ConfigDict(extra="ignore")

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class Durations(_Part):
    """Each stage's own timer, in seconds (this attempt's, for training)."""

    pack: float = 0.0
    preprocess: float = 0.0
    train: float = 0.0
    evaluate: float = 0.0


class Phases(_Part):
    """Where a run's wall time went, in order: the CLI's share and Prefect's flow run creation
    (None for a deployed run), each stage as the flow saw it, the training process's start-up
    to its first step (within train), and the report."""

    config: float | None = None
    imports: float | None = None
    server_start: float | None = None
    flow_start: float | None = None
    pack: float | None = None
    preprocess: float | None = None
    train: float | None = None
    child_start: float | None = None
    evaluate: float | None = None
    report: float | None = None


class PreemptionSummary(_Part):
    preemptions: int = 0
    resumed_from_steps: list[int] = []
    steps_lost: int = 0
    seconds_lost: float = 0.0
    checkpoint_seconds: float = 0.0
    checkpoints_saved: int = 0
    checkpoint_interval: CheckpointInterval | None = None  # the schedule as it ran
    restart_to_first_step_seconds: list[float] = []


class PackSummary(_Part):
    state: str | None = None
    reused: bool = False
    dataset: str = ""
    rows: dict[str, int] = {}
    shards: int = 0
    dir: str = ""
    segments: int = 0  # the dataset's segments
    segments_packed: int = 0  # of them, packed by this run
    source_bytes_read: int = 0
    packed_bytes: int = 0  # written under datasets/ by this run
    uploaded_bytes: int = 0  # to an s3:// root by this run
    dropped_null_labels: int = 0  # source rows left out for a null label (data.drop_null_labels)


class PreprocessSummary(_Part):
    state: str | None = None
    key: str = ""
    stats: str = ""
    target_transform: str | None = None  # regression: the label's transform (auto resolved)


class TrainSummary(_Part):
    state: str | None = None
    already_complete: bool = False
    eval_every: int | None = None  # train.eval_every as used (auto resolved for the train split)
    patience: int | None = None  # train.patience as used, in validations
    best_step: int = 0
    best_val_auc: float | None = None
    best_val_metric: float | None = None
    precision: str = ""
    device: str = ""
    seconds: Seconds = Seconds()
    first_step_latency_seconds: float | None = None
    history: History = []
    threads: ThreadPolicy | None = None
    num_workers: LoaderWorkers = LoaderWorkers()


    @property
    def best(self) -> float | None:
        """The best validation value of eval.metric (a report from before eval.metric: AUC)."""
        return self.best_val_metric if self.best_val_metric is not None else self.best_val_auc


class EvaluateSummary(_Part):
    state: str | None = None


class StageSummaries(_Part):
    pack: PackSummary = PackSummary()
    preprocess: PreprocessSummary = PreprocessSummary()
    train: TrainSummary = TrainSummary()
    evaluate: EvaluateSummary = EvaluateSummary()


class ReportFiles(_Part):
    report_md: str
    curves_png: str | None = None


class RunReport(_Part):
    """report.json (see the module docstring)."""

    run_key: str
    status: str  # completed, early_stopped, budget_stopped
    stop_reason: str | None = None
    steps: int
    task: str = "binary"
    metric: str = "auc"  # eval.metric: the one promotion judged
    metrics: dict[str, float]  # every metric of the task on the test split, exact
    model: ModelRef
    resumed_from_steps: list[int] = []
    preemptions: int = 0
    steps_lost: int = 0
    durations: Durations = Durations()
    preemption: PreemptionSummary = PreemptionSummary()
    cost: CostReport
    utilization: Utilization
    tags: dict[str, str] = {}
    profile: ProfileSummary | None = None  # torch.profiler's top operators
    stages: StageSummaries = StageSummaries()
    target: float | None = None
    target_auc: float | None = None
    target_met: bool | None = None
    promotion: Promotion
    warm_start: WarmStart | None = None
    steps_to_target: int | None = None
    bayes_auc: float | None = None  # the demo generator's Bayes-optimal AUC (demo data only)
    prefect_flow_run_id: str | None = None
    pipeline_started_at: float | None = None  # epoch seconds when the first stage began
    tracking: TrackingNotes | None = None
    files: ReportFiles | None = None
    storage: StorageSummary = StorageSummary()
    phases: Phases = Phases()
    decision: TrainingDecision | None = None  # why it trained, under train.retrain_when drift or degraded
    step_time: StepTime | None = None  # measured seconds per step against plan's prediction for the instance

    @classmethod
    def read(cls, path: Path) -> RunReport:
        """A report.json read back; a damaged one is one StorageError naming it."""
        try:
            return cls.model_validate_json(path.read_bytes())
        except ValueError as err:  # pydantic's ValidationError (bad JSON or a bad field) is one
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise StorageError(f"{path} is not a readable run report ({first})") from None
        except OSError as err:
            raise StorageError(f"cannot read {path}: {err.strerror or err}") from None


class KeptReport(_Part):
    """The report of a run that kept the champion (`train.retrain_when`): what it looked at and
    why it did not train. Written to runs/kept/<flow run>.json."""

    status: str = "kept_champion"
    decision: TrainingDecision
    dataset: str
    source: str
    rows: dict[str, int]
    champion: ModelRef | None = None
    durations: dict[str, float] = {}  # pack, decide
    compute: ComputeCost
    tags: dict[str, str] = {}
    prefect_flow_run_id: str | None = None
    storage: StorageSummary = StorageSummary()


def read_report(path: Path) -> RunReport | KeptReport:
    """A run's report (it trained) or a kept-champion report, by what the file holds."""
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise StorageError(f"cannot read {path}: {err.strerror or err}") from None
    if b'"kept_champion"' in raw:
        try:
            return KeptReport.model_validate_json(raw)
        except ValueError as err:
            raise StorageError(f"{path} is not a readable report ({str(err).splitlines()[0]})") from None
    return RunReport.read(path)
