"""What the pipeline's stages hand each other: typed, frozen, JSON-serialisable values.

Prefect stores and caches them (pydantic models pickle and hash like plain values); tasks, the
report and the artifacts read their attributes. Torch-free: the flow and the CLI import them.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from training.protocol.record import Record
from training.storage.root import StorageSummary
from training.metrics import Metrics
from training.model.paired import PairedDifference

__all__ = ["Evaluation", "LaunchPhases", "PackResult", "PrepResult", "Promotion", "StageEnds", "StageStates",
           "TrainingDecision"]


class LaunchPhases(Record):
    """What `retrain run` spent before the flow's first stage, handed to the report through the
    environment (`ENV`): the flow runs in the CLI's process, but a deployed run has none."""

    ENV: ClassVar[str] = "RETRAIN_LAUNCH_PHASES"

    config_seconds: float  # arguments and the config file
    imports_seconds: float  # Prefect and the pipeline's modules
    server_seconds: float  # the temporary Prefect server's start-up (0 when one was running)
    flow_called_at: float  # epoch seconds when the flow was called


class PackResult(Record):
    """The packed dataset: where it is, what it holds, and whether this run packed it."""

    source: str
    dataset_dir: str
    dataset_uri: str
    fingerprint: str
    rows: dict[str, int]
    shards: int
    reused: bool
    uploaded_bytes: int
    storage: StorageSummary
    bayes_auc: float | None = None  # the demo generator's Bayes-optimal AUC (demo data only)
    started_at: float  # epoch seconds when the pipeline's first stage began
    seconds: float
    parts: int | None = None  # segments this run packed (None: none)
    format_version: int = 2  # 1: a dataset packed by an earlier version, used as it is
    segments: int = 0  # segments the dataset lists
    segments_packed: int = 0  # of them, packed by this run
    source_bytes_read: int = 0  # read from the source: footers of new files and the row groups packed
    packed_bytes: int = 0  # written under datasets/ by this run's packing
    segments_removed: int = 0  # by retention
    dataset_bytes: int = 0  # the dataset's shards
    dropped_null_labels: int = 0  # source rows the dataset leaves out for a null label (data.drop_null_labels)

    @property
    def train_rows(self) -> int:
        return self.rows["train"]


class PrepResult(Record):
    """The fitted (or reused) feature statistics of a dataset."""

    stats_path: str
    stats_rel: str  # relative to storage.root: where they are on S3
    reused: bool
    key: str
    code_version: int
    cardinalities: list[int]
    target_transform: str | None = None  # regression: what preprocess.target_transform resolved to
    seconds: float


class Promotion(Record):
    promoted: bool
    reason: str
    challenger_sha256: str
    champion_sha256: str | None = None
    champion_metrics: Metrics | None = None
    champion_note: str | None = None
    champion_problem: str | None = None
    difference: PairedDifference | None = None  # the evidence, when the champion was scored on the same rows


class Evaluation(Record):
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


class StageStates(Record):
    """The final Prefect state of each stage's task, as the flow saw it (None outside a flow)."""

    pack: str | None = None
    preprocess: str | None = None
    train: str | None = None
    evaluate: str | None = None


class StageEnds(BaseModel):
    """Epoch seconds when the flow began and when each stage ended: the report's phases. The flow
    sets each as its stage ends."""

    model_config = ConfigDict(extra="forbid")

    flow: float
    pack: float | None = None
    preprocess: float | None = None
    train: float | None = None
    evaluate: float | None = None

    def durations(self) -> dict[str, float | None]:
        """Each stage's seconds, from the end of the one before it."""
        out: dict[str, float | None] = {}
        previous: float | None = self.flow
        for stage in ("pack", "preprocess", "train", "evaluate"):
            end = getattr(self, stage)
            out[stage] = end - previous if end is not None and previous is not None else None
            previous = end
        return out


class TrainingDecision(Record):
    """Whether this run trains, and why (a report field and a Prefect artifact)."""

    train: bool
    reason: str
    mode: str  # train.retrain_when
    new_segments: int = 0
    new_rows: int = 0
    drift: dict[str, float] = {}  # PSI of each feature on the new rows
    drifted: list[str] = []  # the features over the threshold
    threshold: float = 0.0
    metric: str = ""
    champion_sha256: str | None = None
    champion_metric: float | None = None  # the test metric it was promoted on
    champion_metric_new: float | None = None  # on the new rows
    seconds: float = 0.0
