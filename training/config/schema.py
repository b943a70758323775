"""The run configuration's schema: one pydantic model (`RetrainConfig`) of sections, each field
with its type, default, description and fingerprint mark. Loading it from YAML and overrides is
`training.config.loading`; the marks and fingerprints are `training.config.marks`."""

from __future__ import annotations

import math
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from training.config.marks import COMPUTED, COMPUTED_SINCE, FLAT_COMPUTED, OPERATIONAL, computed_before
from training.config.prices import DEFAULT_PRICES, DEFAULT_STORAGE_PRICES
from training.config.problems import format_errors
from training.config.space import check_space
from training.errors import ConfigError

__all__ = [
    "TrackingConfig",
    "CostConfig",
    "BudgetConfig",
    "InstancePrice",
    "DataConfig",
    "WindowConfig",
    "PreprocessConfig",
    "ModelConfig",
    "TrainConfig",
    "EvalConfig",
    "StorageConfig",
    "LifecycleConfig",
    "TuneConfig",
    "RetrainConfig",
    "DEMO_NUMERIC",
    "DEMO_CATEGORICAL",
    "TASK_METRICS",
    "metric_name",
]

# The metrics of each data.task (their code: training.model.objectives), the first one the default.
TASK_METRICS: dict[str, tuple[str, ...]] = {
    "binary": ("auc", "logloss", "accuracy"),
    "multiclass": ("accuracy", "macro_f1", "logloss"),
    "regression": ("rmse", "mae", "r2"),
}


def metric_name(metric: str) -> str:
    """How messages name a metric ("AUC", as they always have; others by their key)."""
    return "AUC" if metric == "auc" else metric


DEMO_NUMERIC = ["price", "discount", "rating", "reviews_log", "position", "dwell_prev"]
DEMO_CATEGORICAL = ["category", "device", "region", "brand"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class WindowConfig(_Section):
    last_segments: int | None = Field(
        None, gt=0, description="Keep only the newest N segments (by data.time_column when set, else by source file "
        "name, which orders daily files by day).", json_schema_extra=COMPUTED)
    last_days: float | None = Field(
        None, gt=0, description="Keep only segments whose newest row is within this many days of the newest row of "
        "all (needs data.time_column).", json_schema_extra=COMPUTED)


class DataConfig(_Section):
    source: str | None = Field(
        None,
        description="A Parquet or CSV file (.csv, .tsv, gzipped or not), a folder of them, or an s3:// prefix "
        "of them. Empty: the built-in synthetic "
        "click-through demo dataset, generated once under <storage.root>/demo/; demo:reviews and demo:shapes: "
        "the text and image demos.", json_schema_extra=OPERATIONAL
    )
    task: Literal["binary", "multiclass", "regression"] = Field(
        "binary", description="binary: a 0/1 label; multiclass: integer or string classes (the sorted distinct "
        "values of the train split); regression: a float label, standardised on the train split.",
        json_schema_extra=COMPUTED_SINCE)
    label: str = Field("clicked", description="Label column (its values: see data.task).", json_schema_extra=COMPUTED)
    drop_null_labels: bool = Field(
        False, description="Leave out rows whose label is null (their count is logged); off: a null label is an "
        "error naming its row.", json_schema_extra=COMPUTED_SINCE)
    numeric: list[str] = Field(list(DEMO_NUMERIC), description="Numeric feature columns.", json_schema_extra=COMPUTED)
    categorical: list[str] = Field(
        list(DEMO_CATEGORICAL), description="Categorical feature columns (any type).", json_schema_extra=COMPUTED
    )
    vector: list[str] = Field(
        [], description="Fixed-size list<float> columns (e.g. precomputed embeddings), fed as is.",
        json_schema_extra=COMPUTED_SINCE)
    text: list[str] = Field(
        [], description="String columns. Preprocessing fits a BPE tokenizer on the train split "
        "and stores token ids; the built-in model reads them with a transformer encoder.",
        json_schema_extra=COMPUTED_SINCE)
    image: list[str] = Field(
        [], description="Binary columns holding encoded PNG or JPEG images. Preprocessing decodes "
        "and resizes them once (preprocess.image_size); the built-in model reads them with a small CNN.",
        json_schema_extra=COMPUTED_SINCE)
    validation_fraction: float = Field(0.1, gt=0, lt=0.5, description="Share of rows in the validation split.", json_schema_extra=COMPUTED)
    test_fraction: float = Field(0.1, gt=0, lt=0.5, description="Share of rows in the test split.", json_schema_extra=COMPUTED)
    split_seed: int = Field(0, description="Seed of the deterministic row-to-split assignment.", json_schema_extra=COMPUTED)
    split_key: str | None = Field(
        None, description="A column (e.g. a user id) whose value alone decides a row's split: every row of one key "
        "falls in one split, so no key leaks between train and test. Empty: a row's split follows its file and its "
        "row there. Either way a row keeps its split as files are added.", json_schema_extra=COMPUTED_SINCE)
    rows_per_member: int = Field(4096, gt=0, description="Rows per tar member (micro-batch) in a shard.", json_schema_extra=COMPUTED)
    shard_size_mb: float = Field(16.0, gt=0, description="Target shard size in MB, tar headers counted.", json_schema_extra=COMPUTED)
    segment_rows: int = Field(
        1_048_576, gt=0, description="A source file is packed in segments of consecutive Parquet row groups of at most "
        "this many rows (a row group is never split). A segment is packed once, reused by every dataset that holds it, "
        "and is the unit of parallel packing.", json_schema_extra=COMPUTED_SINCE)
    time_column: str | None = Field(
        None, description="A timestamp, date or numeric (epoch seconds) column: each segment records its oldest and "
        "newest value, which orders segments and lets data.window.last_days keep recent ones.",
        json_schema_extra=COMPUTED_SINCE)
    window: WindowConfig = Field(default_factory=lambda: WindowConfig(), description="Train on recent segments only.",
                                 json_schema_extra=COMPUTED_SINCE)
    pack_parts: int = Field(
        8, ge=1, le=4096,
        description="At most this many segments are packed at once, one task each (across the workers of "
        "data.pack_cluster or of the flow's task runner); the shards are byte-identical for any value.", json_schema_extra=OPERATIONAL
    )
    pack_cluster: str | None = Field(
        None, pattern=r"^(tcp|tls|ucx)://[^\s/]+$",
        description="A Dask scheduler's address (tcp://host:8786): the segments are packed on that cluster's workers "
        "(needs the dask extra; with an s3:// source and root the workers share nothing else with the flow). Unset: on "
        "the flow's own task runner.", json_schema_extra=OPERATIONAL)

    @model_validator(mode="after")
    def _columns_distinct(self) -> DataConfig:
        for key in ("numeric", "categorical"):
            # A label named like one of the demo's default columns takes it out of that default
            # list; named in a list the config gives, it is listed twice (below).
            if key not in self.model_fields_set and self.label in getattr(self, key):
                object.__setattr__(self, key, [c for c in getattr(self, key) if c != self.label])
        columns = [self.label, *self.numeric, *self.categorical, *self.vector, *self.text, *self.image]
        repeated = sorted({c for c in columns if columns.count(c) > 1})
        if repeated:
            raise ValueError(f"columns listed twice across label/numeric/categorical/vector/text/image: {repeated}")
        if len(columns) == 1:
            raise ValueError("no feature columns: set data.numeric, data.categorical, data.vector, data.text "
                             "and/or data.image")
        if self.window.last_days is not None and self.time_column is None:
            raise ValueError("data.window.last_days needs data.time_column: set it to a timestamp or date column")
        return self


class PreprocessConfig(_Section):
    max_vocab: int = Field(1000, gt=0, description="Most frequent categories kept per column; others share one bucket.", json_schema_extra=COMPUTED)
    min_count: int = Field(1, gt=0, description="Categories seen fewer times in the train split are treated as unknown.", json_schema_extra=COMPUTED)
    vocab_size: int = Field(8000, ge=64, le=1_000_000, description="data.text: size of the BPE vocabulary fitted "
                            "on the train split (special tokens included).", json_schema_extra=COMPUTED_SINCE)
    max_tokens: int = Field(128, ge=2, le=65_536, description="data.text: tokens kept per text (a leading [CLS] "
                            "included); longer texts are truncated, shorter ones padded and masked.",
                            json_schema_extra=COMPUTED_SINCE)
    image_size: int | None = Field(None, ge=4, le=4096, description="data.image: images are decoded once, converted "
                                   "to RGB and resized to image_size x image_size. Unset: their own size (the largest "
                                   "side of the first train images), at most 32; smaller images are never scaled up.",
                                   json_schema_extra=COMPUTED_SINCE)
    numeric_bins: int = Field(
        48, ge=2, le=1024, description="Quantile bins of each numeric column's train values, for "
        "model.numeric_embedding: piecewise (fewer where a column has fewer distinct values).",
        json_schema_extra=COMPUTED_SINCE)
    target_transform: Literal["auto", "standardize", "log1p", "quantile"] = Field(
        "auto", description="Regression: the label's transform for training, inverted exactly in evaluation, "
        "predict and the export. standardize; log1p (labels >= 0), then standardised; quantile (the train split's "
        "CDF, then the normal's inverse CDF); auto: log1p when the train labels are all > 0 with a skewness over 1 "
        "and their log's within ±1 (a price, a duration), else standardize.",
        json_schema_extra=COMPUTED_SINCE)


class ModelConfig(_Section):
    factory: str | None = Field(
        None,
        description='User model as "package.module:function" called with (schema, config) (the deprecated form '
        "(n_numeric, cardinalities, config) still works), or as \"package.module:name\" of a "
        "training.model.spec.TrainSpec that also builds the optimizer and the learning-rate schedule; empty: the "
        "built-in model.", json_schema_extra=COMPUTED
    )
    hidden: list[int] = Field([128, 64], description="Hidden layer widths of the MLP.", json_schema_extra=COMPUTED)
    embedding_dim: int = Field(16, gt=0, description="Embedding width per categorical column.", json_schema_extra=COMPUTED)
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout after each hidden layer.", json_schema_extra=COMPUTED)
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory: "
                                         "every other MLP block, and every transformer block.", json_schema_extra=OPERATIONAL)
    text_dim: int = Field(128, gt=0, description="data.text: width of the transformer encoder.", json_schema_extra=COMPUTED_SINCE)
    text_layers: int = Field(2, ge=1, description="data.text: pre-norm transformer blocks.", json_schema_extra=COMPUTED_SINCE)
    text_heads: int = Field(4, ge=1, description="data.text: attention heads (text_dim must divide by it).",
                            json_schema_extra=COMPUTED_SINCE)
    image_channels: list[int] = Field([32, 64], description="data.image: channels of each "
                                      "conv block of the CNN (each block halves the resolution).",
                                      json_schema_extra=COMPUTED_SINCE)
    numeric_embedding: Literal["none", "periodic", "piecewise"] = Field(
        "piecewise", description="How numeric columns enter the MLP: none, as standardised values; periodic, each "
        "through learned sin/cos features and a linear layer with ReLU; piecewise, each through its piecewise-linear "
        "encoding over preprocess.numeric_bins quantile bins of the train split and a linear layer (both from Gorishniy "
        "et al., \"On Embeddings for Numerical Features in Tabular Deep Learning\", 2022, through "
        "rtdl-num-embeddings; piecewise is the paper's version B, which starts as a linear embedding).",
        json_schema_extra=computed_before("none"))
    numeric_embedding_dim: int = Field(24, gt=0, description="model.numeric_embedding: periodic or piecewise: the "
                                       "width of each numeric column's embedding.", json_schema_extra=COMPUTED_SINCE)
    numeric_frequency_scale: float = Field(
        0.01, gt=0, description="model.numeric_embedding: periodic: the standard deviation of the initial frequencies "
        "(the paper's sigma, its most sensitive setting; a search space can tune it).", json_schema_extra=COMPUTED_SINCE)
    attention: Literal["auto", "math", "flash", "efficient", "cudnn"] = Field(
        "auto", description="Attention kernel of torch's scaled_dot_product_attention: auto lets torch choose (flash "
        "or memory-efficient on a GPU); the others force one, and one the device lacks is a config error.",
        json_schema_extra=OPERATIONAL)

    @field_validator("hidden")
    @classmethod
    def _positive_widths(cls, v: list[int]) -> list[int]:
        if any(w <= 0 for w in v):
            raise ValueError(f"every hidden width must be > 0 (got {v})")
        return v

    @field_validator("image_channels")
    @classmethod
    def _positive_channels(cls, v: list[int]) -> list[int]:
        if not v or any(w <= 0 for w in v):
            raise ValueError(f"needs at least one block, each with > 0 channels (got {v})")
        return v

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.text_dim % self.text_heads:
            raise ValueError(f"text_dim ({self.text_dim}) must be a multiple of text_heads ({self.text_heads})")
        return self

    @field_validator("factory")
    @classmethod
    def _factory_form(cls, v: str | None) -> str | None:
        if v is not None and (v.count(":") != 1 or not all(v.split(":"))):
            raise ValueError(f'must look like "package.module:function" (got {v!r})')
        return v


class OptimConfig(_Section):
    """AdamW."""

    lr: float = Field(3e-3, gt=0, description="Peak learning rate of AdamW.", json_schema_extra=COMPUTED)
    lr_reference_batch: int | None = Field(
        None, gt=0, description="Linear scaling rule: lr is the peak rate at this effective batch, and a run with "
        "another effective batch (batch_size x grad_accum) uses lr x effective / lr_reference_batch, after warmup.",
        json_schema_extra=COMPUTED)
    weight_decay: float = Field(1e-4, ge=0, description="AdamW weight decay.", json_schema_extra=COMPUTED)
    grad_clip: float = Field(1.0, ge=0, description="Max gradient norm; 0 disables clipping.", json_schema_extra=COMPUTED)
    fused: bool = Field(
        True, description="AdamW's fused kernel (one pass over all parameters per step, on CPU and CUDA; elsewhere "
        "the per-tensor one): the same update, rounded differently, in a fraction of the optimiser's time. false: "
        "torch's default implementation, as runs before this key.", json_schema_extra=computed_before(False))


class ScheduleConfig(_Section):
    """The learning-rate schedule: linear warmup, then cosine decay to 10 % of the peak."""

    warmup_steps: int = Field(50, ge=0, description="Linear warmup steps, then cosine decay to 10% of optim.lr.",
                              json_schema_extra=COMPUTED)


def _checkpoint_every(v: int | str) -> int | str:
    if isinstance(v, int):
        if v <= 0:
            raise ValueError("must be > 0 steps")
        return v
    text = v.strip().lower()
    if text == "auto":
        return text
    if text.endswith("s"):
        try:
            seconds = float(text[:-1])
        except ValueError:
            seconds = -1
        if seconds > 0:
            return text
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise ValueError('use a step count (200), seconds ("90s") or "auto"')


class CheckpointConfig(_Section):
    """When checkpoints are written and how many are kept; the spot notice that triggers an
    emergency one."""

    every: int | str = Field(
        200, description='Checkpoint interval: N optimizer steps (200), seconds of training ("90s"), or "auto" '
        "for the Young/Daly optimum sqrt(2 x measured save cost x mean_seconds_between_preemptions).",
        json_schema_extra=OPERATIONAL)
    mean_seconds_between_preemptions: float = Field(
        7200.0, gt=0, description='Expected seconds between preemptions; used by every: "auto".',
        json_schema_extra=OPERATIONAL)
    keep_last: int = Field(2, gt=0, description="Checkpoints kept besides the best one.", json_schema_extra=OPERATIONAL)
    spot_notice_url: str | None = Field(
        None, description="Spot-interruption notice URL to poll (off when empty), e.g. "
        "http://169.254.169.254/latest/meta-data/spot/instance-action on AWS; a notice makes the run write an "
        "emergency checkpoint and stop.", json_schema_extra=OPERATIONAL)
    spot_poll_seconds: float = Field(5.0, gt=0, description="Seconds between spot-notice polls.",
                                     json_schema_extra=OPERATIONAL)

    @field_validator("every")
    @classmethod
    def _every(cls, v: int | str) -> int | str:
        return _checkpoint_every(v)

    def interval(self) -> tuple[str, float]:
        """("steps", n) | ("seconds", s) | ("auto", 0)."""
        v = self.every
        if isinstance(v, int):
            return "steps", float(v)
        if v == "auto":
            return "auto", 0.0
        return "seconds", float(v[:-1])


class LoaderConfig(_Section):
    """How the training process feeds itself: loader workers, threads, the shard cache."""

    num_workers: int | Literal["auto"] = Field(
        "auto", description='DataLoader worker processes, or "auto": chosen at start from the measured data stall.',
        json_schema_extra=OPERATIONAL)
    torch_threads: int | Literal["auto"] = Field(
        "auto", description='Intra-op threads of the training process, or "auto": the CPUs it may use (affinity, '
        "container quota) less the cores other processes keep busy, shared among a node's processes, minus one per "
        "DataLoader worker and one for the prefetch thread when it is measured busy; kept across resumes. "
        "`retrain predict` follows it too, keeping one core for its reading and writing threads under auto.",
        json_schema_extra=OPERATIONAL)
    cache_mb: float = Field(
        512.0, ge=0, description="RAM for transformed train shards kept from one epoch to the next, per process "
        "(shared out among DataLoader workers and a node's ranks); shards beyond it are read and transformed again.",
        json_schema_extra=OPERATIONAL)
    resident: bool | Literal["auto"] = Field(
        "auto", description="Hold the whole train split in the training device's memory and gather each batch "
        "there by index (the same rows in the same order as streaming: the same model). auto: on a CUDA GPU when "
        "it fits in resident_memory_fraction of its free memory; true: on any device; false: always stream.",
        json_schema_extra=OPERATIONAL)
    resident_memory_fraction: float = Field(
        0.5, gt=0, le=0.9, description="Share of the device's free memory the resident train split may take.",
        json_schema_extra=OPERATIONAL)

    @field_validator("num_workers")
    @classmethod
    def _workers(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 0:
            raise ValueError('must be >= 0 or "auto"')
        return v

    @field_validator("torch_threads")
    @classmethod
    def _threads(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError('must be >= 1 or "auto"')
        return v


class KubernetesNodesConfig(_Section):
    """Where TorchX's Kubernetes scheduler runs the nodes of a multi-node job: one Volcano job of
    `train.distributed.nnodes` pods, scheduled as a gang (all or none)."""

    namespace: str = Field("default", description="Namespace of the nodes' Volcano job.", json_schema_extra=OPERATIONAL)
    queue: str = Field("default", description="Volcano queue of the job (its gang is admitted there whole).",
                       json_schema_extra=OPERATIONAL)
    image: str | None = Field(None, description="Container image of the nodes: the deployment's image, with this "
                              "project installed. Required with scheduler kubernetes.", json_schema_extra=OPERATIONAL)
    service_account: str | None = Field(
        None, description="Service account of the node pods: how they reach the storage root without secrets in "
        "their spec (IRSA on EKS, Workload Identity on GKE).", json_schema_extra=OPERATIONAL)
    cpu: int = Field(8, ge=1, description="CPUs per node.", json_schema_extra=OPERATIONAL)
    gpu: int = Field(0, ge=0, description="GPUs per node (nvidia.com/gpu); usually train.distributed.nproc_per_node.",
                     json_schema_extra=OPERATIONAL)
    memory_mb: int = Field(32768, ge=256, description="Memory per node (MB).", json_schema_extra=OPERATIONAL)
    priority_class: str | None = Field(None, description="Priority class of the node pods.",
                                       json_schema_extra=OPERATIONAL)
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels the node pods need (e.g. "
                                          "GPU count, spot capacity).", json_schema_extra=OPERATIONAL)
    tolerations: list[dict[str, Any]] = Field(default_factory=list, description="Tolerations of the node pods, as "
                                              "in a pod spec (e.g. of spot nodes' taints).", json_schema_extra=OPERATIONAL)


class DistributedConfig(_Section):
    """Several training processes: torchrun with DDP, on one node or several. Several nodes are
    started by TorchX (`scheduler`) from one frozen job and meet at torchrun's c10d rendezvous."""

    nproc_per_node: int = Field(1, ge=1, description="Training processes per node; above 1 the loop runs under "
                                "torchrun with DDP.", json_schema_extra=OPERATIONAL)
    nnodes: int = Field(1, ge=1, description="Nodes of a multi-node run. Above 1 the train task starts all of them "
                        "through TorchX on train.distributed.scheduler, tears them down when it ends, and starts "
                        "them all again on its retry.", json_schema_extra=OPERATIONAL)
    min_nnodes: int | None = Field(
        None, ge=1, description="Elastic runs: the fewest nodes the job trains on (torchrun's --nnodes min:max); a "
        "lost node then shrinks the group instead of stopping it, and the run resumes on the smaller world size "
        "from its last checkpoint. Empty: nnodes (all of them).", json_schema_extra=OPERATIONAL)
    scheduler: Literal["local_cwd", "kubernetes"] = Field(
        "local_cwd", description="TorchX scheduler that starts the nodes: local_cwd (processes on this machine) or "
        "kubernetes (a Volcano job, gang-scheduled; see train.distributed.kubernetes).", json_schema_extra=OPERATIONAL)
    rdzv_port: int = Field(29500, ge=1024, le=65535, description="Port of the c10d rendezvous on the first node "
                           "(Kubernetes; on this machine each start takes a free port).", json_schema_extra=OPERATIONAL)
    max_restarts: int = Field(
        2, ge=0, description="Times torchrun restarts the group in place when a rank fails, before the attempt ends "
        "and the train task's retry starts every node again.", json_schema_extra=OPERATIONAL)
    kubernetes: KubernetesNodesConfig = Field(default_factory=KubernetesNodesConfig,
                                              description="The nodes' pods with scheduler kubernetes.")
    bucket_mb: float = Field(25.0, gt=0, description="DDP gradient bucket size (MB).", json_schema_extra=OPERATIONAL)
    timeout_s: float = Field(300.0, gt=0, description="Collective timeout: a hung rank fails the job after this.",
                             json_schema_extra=OPERATIONAL)
    join_timeout_s: float = Field(
        900.0, ge=10, description="nnodes > 1: how long the rendezvous waits for the nodes (torchrun's join_timeout); "
        "a node that has not come by then fails the attempt, which is retried as a preemption.",
        json_schema_extra=OPERATIONAL)

    @model_validator(mode="after")
    def _nodes(self) -> DistributedConfig:
        if self.min_nnodes is not None and self.min_nnodes > self.nnodes:
            raise ValueError(f"train.distributed.min_nnodes {self.min_nnodes} is above train.distributed.nnodes "
                             f"{self.nnodes}")
        if self.nnodes > 1 and self.scheduler == "kubernetes" and not self.kubernetes.image:
            raise ValueError("train.distributed.scheduler kubernetes needs train.distributed.kubernetes.image (the "
                             "deployment's image)")
        return self

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


class RetryConfig(_Section):
    """Coming back after a preemption: the train task's retries and the flow run's restarts."""

    max_retries: int = Field(3, ge=0, description="Times the train task is retried after a preemption.",
                             json_schema_extra=OPERATIONAL)
    delay_seconds: float = Field(10.0, ge=0, description="First retry delay; doubles each retry.",
                                 json_schema_extra=OPERATIONAL)
    max_restarts: int = Field(
        5, ge=0, description="Times a deployed flow run is started again after its machine was reclaimed or lost (a "
        "SIGTERM reschedule, or the shipped automation rescheduling a crashed run) before it fails.",
        json_schema_extra=OPERATIONAL)


class TrainConfig(_Section):
    max_steps: int = Field(2000, gt=0, description="Optimizer steps at most.", json_schema_extra=COMPUTED)
    init_from: Literal["none", "champion"] = Field(
        "none",
        description="champion: warm-start from the current champion when its architecture and feature "
        "columns match (it then keeps the champion's preprocessing, its vocabularies grown by new categories and "
        "its output layer by new classes); "
        "otherwise a fresh start.", json_schema_extra=COMPUTED)
    warm_steps: int | None = Field(
        None, gt=0, description="Optimizer steps of a warm start. Empty: scaled to the data new since the champion "
        "was trained, so that a run on data that grew by 5 % costs about 5 %: three times the new rows' share of the "
        "train split, times train.max_steps, at least train.eval_every (one validation) and at most train.max_steps.",
        json_schema_extra=COMPUTED_SINCE)
    warm_lr_scale: float = Field(
        0.1, gt=0, le=1, description="Peak learning rate of a warm start, as a fraction of optim.lr. The champion's "
        "run ended at 10 % of its peak; warming back up to the full peak, with the optimizer's moments fresh, undoes "
        "part of what it learned: a short warm start then ends worse than the champion it started from.",
        json_schema_extra=COMPUTED_SINCE)
    new_data_weight: float = Field(
        1.0, ge=1, description="A warm start's batches mix the rows new since the champion was trained with replayed "
        "old rows: the new rows' share of each batch is their share of the train split times this (at most 90 %). "
        "1: in proportion, so even a short warm start sees them; above 1: more of the new, less replay.",
        json_schema_extra=COMPUTED_SINCE)
    batch_size: int = Field(
        512, gt=0, description="Rows per micro-batch, across all processes: each of N processes takes batch_size/N.",
        json_schema_extra=COMPUTED)
    grad_accum: int = Field(1, gt=0, description="Micro-batches per optimizer step; the loss is divided by it.",
                            json_schema_extra=COMPUTED)
    eval_every: int | Literal["auto"] = Field(
        "auto", description="Validate every N optimizer steps. auto: once an epoch of the train split (its rows / "
        "(batch_size x grad_accum)), at least every 10 and at most every 200 steps: a small dataset is validated "
        "often enough for early stopping to find its best step.", json_schema_extra=COMPUTED)
    patience: int | Literal["auto"] = Field(
        "auto", description="Validations without improvement before early stop; 0 disables. auto: as many as "
        "make 500 optimizer steps, at least 5 (a noisy validation metric on a small split stops nothing early).",
        json_schema_extra=COMPUTED)
    min_delta: float = Field(1e-4, ge=0, description="Smallest gain of the validation eval.metric that counts as "
                             "improvement.", json_schema_extra=COMPUTED)
    seed: int = Field(0, description="Seed of model init, data order and dropout.", json_schema_extra=COMPUTED)
    deterministic: bool = Field(True, description="Deterministic kernels, so a resumed run is bit-identical.",
                                json_schema_extra=COMPUTED)
    precision: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto", description="auto: bf16 on CUDA GPUs that support it, fp16 on older GPUs, fp32 on CPU.",
        json_schema_extra=OPERATIONAL)
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: CUDA when available.",
                                                   json_schema_extra=OPERATIONAL)
    auto_batch_size: bool = Field(
        False, description="At start, find the largest micro-batch that fits accelerator memory; grad_accum keeps "
        "the effective batch (batch_size x grad_accum) and so the learning rate as configured.",
        json_schema_extra=OPERATIONAL)
    memory_fraction: float = Field(0.9, gt=0, le=1, description="Share of accelerator memory auto_batch_size may "
                                   "plan for.", json_schema_extra=OPERATIONAL)
    simulated_memory_mb: float | None = Field(
        None, gt=0, description="Accelerator memory to plan for where there is none to measure (CPU runs, tests).",
        json_schema_extra=OPERATIONAL)
    compile: bool = Field(False, description="Run the model through torch.compile (one-time warm-up kept out of the "
                          "timings).", json_schema_extra=OPERATIONAL)
    profile: bool = Field(False, description="Record a short torch.profiler trace into the run folder; top ops in the "
                          "report.", json_schema_extra=OPERATIONAL)
    measure_fp32: bool = Field(
        False, description="After a bf16 or fp16 run, time fp32 steps on a copy of the model (26 forward and backward "
        "passes) for the report's naive fp32 counterfactual and its precision advice. Off: the naive run is priced at "
        "this run's step time, and the report says so.", json_schema_extra=OPERATIONAL)
    # Sections. optim and schedule compute: their fields join the run key as if they were this
    # section's own (FLAT), so run keys written before the sections existed stay what they were.
    retrain_when: Literal["always", "drift", "degraded"] = Field(
        "always", description="always: every run trains. drift: a run trains when a feature of the data new since "
        "the champion was trained drifted (PSI over train.drift_threshold) or the champion scores worse on it than "
        "when it was promoted (by more than eval.min_delta); otherwise it keeps the champion, says why and costs "
        "seconds. degraded: only the champion's score on the new data decides. A champion of another model.* or "
        "other data columns always trains.", json_schema_extra=OPERATIONAL)
    drift_threshold: float = Field(
        0.2, gt=0, description="train.retrain_when: drift: the population stability index (PSI) over which a feature "
        "counts as drifted (0.1-0.2 is commonly read as moderate, over 0.2 as large).", json_schema_extra=OPERATIONAL)
    optim: OptimConfig = Field(default_factory=OptimConfig, json_schema_extra=FLAT_COMPUTED,
                               description="The optimizer: AdamW's learning rate, weight decay, clipping, its kernel.")
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig, json_schema_extra=FLAT_COMPUTED,
                                     description="The learning-rate schedule: warm-up, then decay.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, json_schema_extra=OPERATIONAL,
                                         description="When checkpoints are written and how many are kept; the spot notice.")
    loader: LoaderConfig = Field(default_factory=LoaderConfig, json_schema_extra=OPERATIONAL,
                                 description="Loading batches: worker processes, threads, the shard cache.")
    distributed: DistributedConfig = Field(default_factory=DistributedConfig, json_schema_extra=OPERATIONAL,
                                           description="Data-parallel training over several processes and nodes (DDP).")
    retry: RetryConfig = Field(default_factory=RetryConfig, json_schema_extra=OPERATIONAL,
                               description="Retries after a preemption, and how often a flow run may be restarted.")

    @model_validator(mode="after")
    def _world(self) -> TrainConfig:
        world, d = self.world_size, self.distributed
        if self.batch_size % world:
            raise ValueError(
                f"train.batch_size {self.batch_size} must be divisible by nproc_per_node x nnodes = {world} "
                "(it is the global micro-batch, split evenly across processes)"
            )
        if self.optim.lr_reference_batch is not None and self.schedule.warmup_steps == 0:
            raise ValueError("train.optim.lr_reference_batch scales the learning rate: it needs "
                             "train.schedule.warmup_steps > 0")
        if d.nnodes > 1 and d.scheduler == "kubernetes" and d.kubernetes.gpu > 0 and self.precision == "auto":
            raise ValueError("train.precision auto cannot be resolved for nodes on Kubernetes from the launcher (it "
                             "has no GPU to ask): name it (bf16 on A100, L4, H100 and later; fp16 on T4 and V100)")
        for nodes in range(d.min_nnodes or d.nnodes, d.nnodes + 1):
            if self.batch_size % (nodes * d.nproc_per_node):
                raise ValueError(f"train.batch_size {self.batch_size} must be divisible by nproc_per_node x nodes = "
                                 f"{nodes * d.nproc_per_node} for every node count from train.distributed.min_nnodes "
                                 "to nnodes (an elastic run may train on any of them)")
        return self

    @field_validator("eval_every", "patience", mode="before")
    @classmethod
    def _count_or_auto(cls, v: Any, info: Any) -> Any:
        least = 1 if info.field_name == "eval_every" else 0
        if isinstance(v, str) and v.strip().lower() == "auto":
            return "auto"
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise ValueError(f"must be an integer >= {least} or auto")
        return v

    @property
    def world_size(self) -> int:
        return self.distributed.world_size

    def for_train_rows(self, rows: int) -> TrainConfig:
        """This section with `auto` validation settings resolved for a train split of `rows`
        rows (see train.eval_every and train.patience)."""
        every = (self.eval_every if self.eval_every != "auto"
                 else max(10, min(200, math.ceil(rows / (self.batch_size * self.grad_accum)))))
        patience = self.patience if self.patience != "auto" else max(5, math.ceil(500 / every))
        return self.model_copy(update={"eval_every": every, "patience": patience})

    @property
    def validate_every(self) -> int:
        """train.eval_every, resolved (`for_train_rows`) before training reads it."""
        if self.eval_every == "auto":
            raise RuntimeError("train.eval_every is auto here: resolve it with for_train_rows first")
        return self.eval_every

    @property
    def patience_validations(self) -> int:
        if self.patience == "auto":
            raise RuntimeError("train.patience is auto here: resolve it with for_train_rows first")
        return self.patience

    def peak_lr(self) -> float:
        """optim.lr, scaled linearly with the effective batch when optim.lr_reference_batch is set."""
        lr, reference = self.optim.lr, self.optim.lr_reference_batch
        return lr if reference is None else lr * self.batch_size * self.grad_accum / reference


class EvalConfig(_Section):
    metric: str | None = Field(
        None, description="Metric for early stopping, the champion gate and promotion: auc, logloss or accuracy "
        "(binary), accuracy, macro_f1 or logloss (multiclass), rmse, mae or r2 (regression). Empty: auc, accuracy "
        "or rmse by data.task. Lower is better for logloss, rmse and mae.", json_schema_extra=COMPUTED_SINCE)
    target: float | None = Field(None, description="Test value of eval.metric a model must reach to be promoted "
                                 "(at least it, or at most it for a lower-is-better metric).", json_schema_extra=OPERATIONAL)
    target_auc: float | None = Field(None, gt=0, le=1, description="Old name of eval.target for the auc metric; still read.", json_schema_extra=OPERATIONAL)
    min_delta: float = Field(0.0, ge=0, description="Test improvement of eval.metric the challenger needs over the champion.", json_schema_extra=OPERATIONAL)
    promote_on: Literal["interval", "point"] = Field(
        "interval", description="interval: promote only when the lower bound of the improvement's confidence "
        "interval (both models on the same test rows: DeLong for auc, a paired bootstrap otherwise) clears "
        "eval.min_delta, so noise never wins; point: when the improvement itself does.", json_schema_extra=OPERATIONAL)
    confidence: float = Field(0.95, gt=0, lt=1, description="Confidence level of the improvement's interval "
                              "(eval.promote_on: interval).", json_schema_extra=OPERATIONAL)

    @model_validator(mode="after")
    def _one_target(self) -> EvalConfig:
        if self.target is not None and self.target_auc is not None and self.target != self.target_auc:
            raise ValueError("eval.target and its old name eval.target_auc disagree: set only eval.target")
        return self

    def target_value(self) -> float | None:
        """eval.target, or the old eval.target_auc."""
        return self.target if self.target is not None else self.target_auc


class InstancePrice(_Section):
    gpus: int = Field(0, ge=0, description="Accelerators on the instance.", json_schema_extra=OPERATIONAL)
    gpu_memory_gb: float | None = Field(None, gt=0, description="Memory of each accelerator in GB; `retrain plan` "
                                        "refuses the instance for a model that would not fit. Empty: not checked.",
                                        json_schema_extra=OPERATIONAL)
    on_demand_per_hour: float = Field(ge=0, description="On-demand $/h for the whole instance.", json_schema_extra=OPERATIONAL)
    spot_per_hour: float | None = Field(None, ge=0, description="Spot $/h for the whole instance; empty: not offered.", json_schema_extra=OPERATIONAL)
    relative_speed: float = Field(
        1.0, gt=0, description="Training throughput relative to the machine `retrain plan` calibrates on; used only "
        "for an instance without a `gpu` (a GPU's step time is predicted from its published figures).",
        json_schema_extra=OPERATIONAL
    )
    gpu: str | None = Field(None, description="The GPU model, a key of training.cost.hardware.GPUS (T4, A10G, "
                            "V100-16GB, A100-40GB, A100-80GB, A100-80GB-PCIe, H100): `retrain plan` predicts its step "
                            "time from the GPU's published throughput and bandwidth.", json_schema_extra=OPERATIONAL)
    vcpus: int | None = Field(None, gt=0, description="The host's vCPUs: `retrain plan` caps a GPU's step rate at what "
                              "they can load, from this machine's measured loading pace per core; without a `gpu`, it "
                              "predicts the step from this machine's, carried to the instance's cores.",
                              json_schema_extra=OPERATIONAL)
    memory_gb: float | None = Field(None, gt=0, description="The host's memory in GB: `retrain plan` refuses an "
                                    "instance without a `gpu` whose memory the training would not fit.",
                                    json_schema_extra=OPERATIONAL)
    interruption_band: Literal["<5%", "5-10%", "10-15%", "15-20%", ">20%"] | None = Field(
        None, description="Monthly spot interruption frequency band (AWS Spot Instance Advisor); empty: the shipped "
        "band for cost.region, else train.checkpoint.mean_seconds_between_preemptions.", json_schema_extra=OPERATIONAL)

    measured_step_seconds: float | None = Field(
        None, gt=0, description="Seconds per optimizer step measured on this instance type for this model (a run's "
        "report: `plan.actual_step_seconds`); `retrain plan` uses it instead of the prediction.",
        json_schema_extra=OPERATIONAL)

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, v: str | None) -> str | None:
        from training.cost.hardware import GPUS

        if v is not None and v not in GPUS:
            raise ValueError(f"unknown GPU {v!r}; known: {', '.join(GPUS)}")
        return v




class CostConfig(_Section):
    instance_type: str = Field("local-cpu", description="The instance type this run runs on (a key of cost.prices), "
                               "or auto: the pick of the last `retrain plan` on this storage root, with the memory "
                               "variant it chose.", json_schema_extra=OPERATIONAL)
    market: Literal["on_demand", "spot"] = Field("on_demand", description="Market this run is billed on.", json_schema_extra=OPERATIONAL)
    region: str = Field("us-east-1", description="Cloud region whose shipped spot interruption bands `retrain plan` "
                        "uses (us-east-1, us-west-2, eu-west-1).", json_schema_extra=OPERATIONAL)
    prices: dict[str, InstancePrice] = Field(
        {k: InstancePrice(**v) for k, v in DEFAULT_PRICES.items()},
        description="Instance type -> GPUs and $/h; entries given here are merged over the defaults.", json_schema_extra=OPERATIONAL
    )
    storage_per_gb_month: dict[str, float] = Field(
        dict(DEFAULT_STORAGE_PRICES), description="$/GB-month per storage class.", json_schema_extra=OPERATIONAL
    )
    storage_class: dict[str, str] = Field(
        {"shards": "STANDARD", "checkpoints": "STANDARD", "models": "STANDARD"},
        description="Storage class per object class (shards, checkpoints, models).", json_schema_extra=OPERATIONAL
    )
    retention_days: dict[str, float] = Field(
        {"shards": 30.0, "checkpoints": 7.0, "models": 365.0},
        description="Days each object class is kept, for the storage estimate.", json_schema_extra=OPERATIONAL
    )
    tags: dict[str, str] = Field(
        {}, description="Cost-allocation tags (e.g. team, project, owner) for the report and objects.", json_schema_extra=OPERATIONAL
    )

    @field_validator("prices", mode="before")
    @classmethod
    def _merge_prices(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        merged: dict[str, Any] = {k: dict(p) for k, p in DEFAULT_PRICES.items()}
        for name, entry in v.items():
            if isinstance(entry, BaseModel):
                entry = entry.model_dump()
            merged[name] = {**merged.get(name, {}), **entry} if isinstance(entry, dict) else entry
        return merged

    @field_validator("tags")
    @classmethod
    def _object_tags(cls, v: dict[str, str]) -> dict[str, str]:
        # S3 allows 10 tags per object; the pipeline adds retrain-class and retrain-run.
        if len(v) > 8:
            raise ValueError(f"cost.tags has {len(v)} tags; S3 objects take at most 8 besides the pipeline's 2")
        for key, value in v.items():
            if not key or len(key) > 128 or len(value) > 256 or key.lower().startswith(("aws:", "retrain-")):
                raise ValueError(f"cost.tags.{key}: keys are 1-128 characters, values up to 256, and "
                                 "'aws:' and 'retrain-' prefixes are reserved")
        return v

    @model_validator(mode="after")
    def _known_instance(self) -> CostConfig:
        if self.instance_type == "auto":
            pass  # the last `retrain plan`'s pick, resolved when the run starts
        elif self.instance_type not in self.prices:
            raise ValueError(
                f"cost.instance_type {self.instance_type!r} has no entry in cost.prices "
                f"(known: {sorted(self.prices)}); add one to your config"
            )
        elif self.market == "spot" and self.prices[self.instance_type].spot_per_hour is None:
            raise ValueError(f"cost.market is spot but cost.prices[{self.instance_type!r}].spot_per_hour is empty")
        for cls_name in ("shards", "checkpoints", "models"):
            storage_class = self.storage_class.get(cls_name)
            if storage_class not in self.storage_per_gb_month:
                raise ValueError(f"cost.storage_class.{cls_name}: {storage_class!r} has no price in cost.storage_per_gb_month")
            if cls_name not in self.retention_days:
                raise ValueError(f"cost.retention_days.{cls_name} is missing")
        return self

    def rate(self) -> tuple[float, int]:
        """($/h, GPUs) of the declared instance on the declared market."""
        if self.instance_type == "auto":
            raise ConfigError("cost.instance_type is auto: the run resolves it from the last `retrain plan` "
                              "(training.registry.step_times.resolve_planned_instance) before pricing")
        entry = self.prices[self.instance_type]
        rate = entry.spot_per_hour if self.market == "spot" else entry.on_demand_per_hour
        return float(rate or 0.0), entry.gpus


class BudgetConfig(_Section):
    max_usd: float | None = Field(None, gt=0, description="Stop training before the run's bill would exceed this.", json_schema_extra=OPERATIONAL)
    max_gpu_hours: float | None = Field(None, gt=0, description="Stop training before GPU-hours would exceed this.", json_schema_extra=OPERATIONAL)
    max_wall_seconds: float | None = Field(None, gt=0, description="Stop training before the run's wall time would exceed this.", json_schema_extra=OPERATIONAL)
    champion_gate: bool = Field(
        False, description="Stop early when the validation AUC's trend cannot reach the champion's plus eval.min_delta.", json_schema_extra=OPERATIONAL
    )


# S3 storage classes a lifecycle rule may transition to (PutBucketLifecycleConfiguration).
TRANSITION_CLASSES = ("STANDARD_IA", "ONEZONE_IA", "INTELLIGENT_TIERING", "GLACIER_IR", "GLACIER", "DEEP_ARCHIVE")


class LifecycleConfig(_Section):
    manage: bool = Field(True, description="Ensure the bucket's lifecycle rules for this root (merged, idempotent).", json_schema_extra=OPERATIONAL)
    checkpoint_transition_days: int = Field(7, ge=1, description="Days until checkpoints move to a colder class.", json_schema_extra=OPERATIONAL)
    checkpoint_storage_class: str = Field("GLACIER_IR", description="The colder class checkpoints move to.", json_schema_extra=OPERATIONAL)
    checkpoint_expire_days: int = Field(30, ge=1, description="Days until checkpoints are deleted.", json_schema_extra=OPERATIONAL)
    shard_cache_expire_days: int = Field(30, ge=1, description="Days until packed shards (rebuildable) are deleted.", json_schema_extra=OPERATIONAL)
    abort_multipart_days: int = Field(1, ge=1, description="Days until an unfinished multipart upload is aborted.", json_schema_extra=OPERATIONAL)

    @model_validator(mode="after")
    def _order(self) -> LifecycleConfig:
        if self.checkpoint_storage_class not in TRANSITION_CLASSES:
            raise ValueError(
                f"storage.lifecycle.checkpoint_storage_class {self.checkpoint_storage_class!r} is not one of "
                f"{list(TRANSITION_CLASSES)}"
            )
        if self.checkpoint_expire_days <= self.checkpoint_transition_days:
            raise ValueError(
                f"storage.lifecycle.checkpoint_expire_days ({self.checkpoint_expire_days}) must be greater than "
                f"checkpoint_transition_days ({self.checkpoint_transition_days})"
            )
        return self


class StorageConfig(_Section):
    root: str = Field(".retrain", description="Root of datasets, caches, runs and models: a folder or s3://bucket/prefix.", json_schema_extra=OPERATIONAL)
    endpoint_url: str | None = Field(
        None, description="S3-compatible endpoint (MinIO, R2, Ceph). Empty: AWS_ENDPOINT_URL, else AWS S3.", json_schema_extra=OPERATIONAL
    )
    region: str | None = Field(None, description="S3 region. Empty: the AWS configuration's default.", json_schema_extra=OPERATIONAL)
    credentials_block: str | None = Field(
        None, description="Name of a Prefect AwsCredentials block. Empty: the standard AWS credential chain.", json_schema_extra=OPERATIONAL
    )
    local_dir: str | None = Field(
        None, description="Local working copy of an s3:// root. Empty: ~/.cache/retrain/s3/<bucket>/<prefix>.", json_schema_extra=OPERATIONAL
    )
    shard_cache_gb: float = Field(20.0, gt=0, description="Size limit of the local cache of shards read from S3.", json_schema_extra=OPERATIONAL)
    keep_datasets: int = Field(
        3, ge=0, description="Packed datasets kept besides the one a run uses (the newest); segments no kept dataset "
        "lists are removed, here and on S3. A removed dataset is packed again, from its source, if asked for.",
        json_schema_extra=OPERATIONAL)
    multipart_mb: int = Field(64, ge=5, description="Objects above this many MB upload in parts of this size.", json_schema_extra=OPERATIONAL)
    connect_timeout_s: float = Field(5.0, gt=0, description="S3 connect timeout per attempt.", json_schema_extra=OPERATIONAL)
    read_timeout_s: float = Field(30.0, gt=0, description="S3 read timeout per attempt.", json_schema_extra=OPERATIONAL)
    max_attempts: int = Field(5, ge=1, le=20, description="Attempts per S3 request, with exponential backoff.", json_schema_extra=OPERATIONAL)
    heartbeat_seconds: float = Field(
        30.0, gt=0, description="How often a run on an s3:// root records its step on S3, so a resume on a fresh "
        "machine counts the work lost to within this interval. One small PUT each time.", json_schema_extra=OPERATIONAL
    )
    lifecycle: LifecycleConfig = Field(default_factory=LifecycleConfig, json_schema_extra=OPERATIONAL,
                                       description="S3 lifecycle rules by object class (shards, checkpoints, models, runs).")

    @field_validator("root")
    @classmethod
    def _root(cls, v: str) -> str:
        if v.startswith("s3://"):
            bucket, _, prefix = v[5:].partition("/")
            if not bucket:
                raise ValueError(f"storage.root {v!r} names no bucket; write s3://bucket/prefix")
            # The prefix also names the local working copy (~/.cache/retrain/s3/<bucket>/<prefix>):
            # '..' would put it outside the cache.
            if any(part in (".", "..") for part in [bucket, *prefix.split("/")]) or "\\" in v:
                raise ValueError(f"storage.root {v!r}: '.' and '..' are not allowed in an s3:// root; "
                                 f"write the prefix without them")
        elif "://" in v:
            raise ValueError(f"storage.root {v!r}: only local folders and s3:// roots are supported")
        return v

    @property
    def is_s3(self) -> bool:
        return self.root.startswith("s3://")



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


class RetrainConfig(_Section):
    """Everything that defines a retraining run."""

    data: DataConfig = Field(default_factory=DataConfig, json_schema_extra=COMPUTED,
                             description="The source data: where it is, the label, the feature columns, splits and packing.")
    preprocess: PreprocessConfig = Field(default_factory=PreprocessConfig, json_schema_extra=COMPUTED,
                                         description="Feature statistics and encodings fitted on the train split (cached).")
    model: ModelConfig = Field(default_factory=ModelConfig, json_schema_extra=COMPUTED,
                               description="The network: widths, embeddings, dropout, or your own model.factory.")
    train: TrainConfig = Field(default_factory=TrainConfig, json_schema_extra=COMPUTED,
                               description="Training: steps, batch, validation, early stopping, precision, device.")
    eval: EvalConfig = Field(default_factory=EvalConfig, json_schema_extra=OPERATIONAL,
                             description="Evaluation and the champion/challenger gate: the metric, the target, the margin.")
    storage: StorageConfig = Field(default_factory=StorageConfig, json_schema_extra=OPERATIONAL,
                                   description="The storage root (a folder or s3://) and what it keeps.")
    cost: CostConfig = Field(default_factory=CostConfig, json_schema_extra=OPERATIONAL,
                             description="What the machine costs: its instance type, market, prices and cost tags.")
    budget: BudgetConfig = Field(default_factory=BudgetConfig, json_schema_extra=OPERATIONAL,
                                 description="Spending limits that stop a run gracefully: dollars, GPU-hours, seconds.")
    tune: TuneConfig = Field(default_factory=TuneConfig, json_schema_extra=OPERATIONAL,
                             description="Hyperparameter search (retrain tune): the space, the pruner, the budget.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, json_schema_extra=OPERATIONAL,
                                     description="MLflow tracking and the model registry (optional).")

    @model_validator(mode="after")
    def _metric_of_task(self) -> RetrainConfig:
        metric, task = self.eval.metric, self.data.task
        if metric is not None and metric not in TASK_METRICS[task]:
            raise ValueError(f"eval.metric {metric!r} is not a {task} metric; use one of {list(TASK_METRICS[task])}")
        if self.eval.target_auc is not None and (task != "binary" or self.eval.metric not in (None, "auc")):
            raise ValueError("eval.target_auc is the target of the binary auc metric; set eval.target instead")
        if self.tune.space:
            check_space(self)
        return self

    def for_train_rows(self, rows: int) -> RetrainConfig:
        """This config with its data-dependent `auto` settings resolved for a train split of `rows` rows."""
        return self.model_copy(update={"train": self.train.for_train_rows(rows)})

    def with_values(self, values: dict[str, Any], origin: str) -> RetrainConfig:
        """This config with each dotted key of `values` set (e.g. a tuning trial's parameters),
        validated; `origin` names where the values come from in an error."""
        raw = {**self.raw_with(values), "tune": self.tune.model_dump(mode="json")}
        try:
            return type(self).model_validate(raw)
        except ValidationError as err:
            raise ConfigError(format_errors(err, origin, type(self))) from None

    def value_at(self, key: str) -> Any:
        """The JSON value of a dotted key (e.g. `train.optim.lr`), as `with_values` would set it."""
        node: Any = self.model_dump(mode="json", exclude={"tune"})
        for part in key.split("."):
            node = node[part]
        return node

    def raw_with(self, values: dict[str, Any]) -> dict[str, Any]:
        """This config as JSON, without its tune section, with each dotted key of `values` set."""
        raw = self.model_dump(mode="json", exclude={"tune"})
        for key, value in values.items():
            *path, name = key.split(".")
            node = raw
            for part in path:
                node = node[part]
            node[name] = value
        return raw

