"""`train`: steps, batch, optimizer and schedule, checkpoints, the loader, distribution,
retries, validation and early stopping."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from training.config.marks import COMPUTED, COMPUTED_SINCE, FLAT_COMPUTED, OPERATIONAL, computed_before
from training.config.section import _Section
from training.copies import updated

__all__ = ["CheckpointConfig", "DistributedConfig", "KubernetesNodesConfig", "LoaderConfig", "OptimConfig", "RetryConfig", "ScheduleConfig", "TrainConfig"]


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
    compile: bool | Literal["auto"] = Field(
        "auto", description="Run the model through torch.compile (its one-time warm-up kept out of the timings). auto: "
        "on a CUDA device, when the steps left could pay the compile back (at the most a compile was measured to "
        "save, a fifth of an eager step, against the compile time: measured before on this machine, else 30 s), and "
        "kept only where the compiled step is then measured faster; never on a CPU, where it saved nothing on the "
        "default model.", json_schema_extra=OPERATIONAL)
    step: Literal["auto", "eager", "graph"] = Field(
        "auto", description="How a training step runs. graph: the whole step (forward, backward, clipping, the AdamW "
        "update) on tensors at fixed addresses, captured once as a CUDA graph and replayed (on a CPU it runs as is). "
        "eager: op by op, as PyTorch runs a model. auto: graph on CUDA where the step can be captured (the built-in "
        "optimizer and schedule, one process, not fp16), else eager, saying why in one line.",
        json_schema_extra=OPERATIONAL)
    steps_per_block: int | Literal["auto"] = Field(
        "auto", description="Optimizer steps the loop runs back to back before its host work (timing, the heartbeat, "
        "budgets and stop decisions, the ranks' agreement); validation and step-counted checkpoints still land on "
        "their steps, so it must divide train.eval_every and a step-counted train.checkpoint.every. auto: the "
        "fewest at which that work costs under 2 % of the block's steps, at most half a second of them (a stop "
        "lands at the next block's end).", json_schema_extra=OPERATIONAL)
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
        block = self.steps_per_block
        if block != "auto" and (isinstance(block, bool) or block < 1):
            raise ValueError(f"train.steps_per_block must be an integer >= 1 or auto (got {block!r})")
        if block != "auto" and self.eval_every != "auto" and self.eval_every % block:
            raise ValueError(f"train.steps_per_block {block} must divide train.eval_every {self.eval_every}: "
                             "validation runs between blocks; set steps_per_block to a divisor, or auto")
        mode, every = self.checkpoint.interval()
        if block != "auto" and mode == "steps" and int(every) % block:
            raise ValueError(f"train.steps_per_block {block} must divide train.checkpoint.every {int(every)}: "
                             "checkpoints are written between blocks; set steps_per_block to a divisor, or auto")
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
        return updated(self, {"eval_every": every, "patience": patience})

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
