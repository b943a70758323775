"""Everything that shapes the future of a run, in one object that saves and loads in one call.

`TrainState` holds the model, optimizer, LR scheduler, grad scaler, early stopping and the run's
`Progress` (step, data position, history, time and cost accumulators, batch layout); its
`state_dict()` adds every RNG. A checkpoint is exactly `TrainState.state_dict()`, and a resume is
exactly `load_state_dict()`, so a killed run resumes bit-identical to an uninterrupted one
(deterministic mode, same hardware). The parts are listed once, in `_parts()`: a piece of state
added there is saved and restored, and one left out of it is in neither.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol

import torch

from training.config import RetrainConfig
from training.errors import ConfigError
from training.model.memory_fit import check_model_fits
from training.model.network import ModelSchema
from training.model.spec import train_spec
from training.protocol.results import Seconds, Validation
from training.trainer.rng import RngState, capture_rng, restore_rng

__all__ = ["EarlyStopping", "Progress", "TrainState"]



@dataclass
class Progress:
    """Counters that survive resumes: where the run is, what it has spent, what it decided once."""

    step: int = 0
    epoch: int = 0
    batch: int = 0
    history: list[Validation] = field(default_factory=list)
    resumed_from_steps: list[int] = field(default_factory=list)
    preemptions: int = 0
    steps_lost: int = 0
    seconds: Seconds = field(default_factory=Seconds)
    checkpoints_saved: int = 0
    last_save_train_seconds: float = 0.0
    save_cost_seconds: float | None = None  # moving average of measured save cost
    restart_to_first_step_seconds: list[float] = field(default_factory=list)
    stop_reason: str | None = None
    stopped: str | None = None  # the status of a run that stopped before max_steps (see training.trainer.stopping)
    # The micro-batch layout is decided once, at the run's first start, and kept across
    # resumes: the data position counts global micro-batches of this size.
    micro_batch: int | None = None  # rows per global micro-batch (all processes)
    grad_accum: int | None = None
    auto_batch: dict[str, Any] | None = None  # AutoBatch as JSON: a checkpoint holds plain values only
    num_workers: int | None = None  # what num_workers="auto" chose at the first start
    torch_threads: int | None = None  # what torch_threads="auto" chose at the first start
    compile_seconds: float | None = None  # the last attempt's torch.compile (train.compile auto prices the next)

    def billed_seconds(self) -> float:
        """Every second the machine was held for this run, lost work and restarts included."""
        return self.seconds.billed()

    def record_save_cost(self, stall: float) -> None:
        self.seconds.checkpoint += stall
        previous = self.save_cost_seconds
        self.save_cost_seconds = stall if previous is None else 0.7 * previous + 0.3 * stall

    def state_dict(self) -> dict[str, Any]:
        """Plain values only (a checkpoint loads with weights_only=True), and a deep copy: later
        steps cannot change a checkpoint being written. The seconds and validations keep the
        form checkpoints always had."""
        state = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name not in ("seconds", "history")}
        return {**state, "seconds": self.seconds.model_dump(), "history": [v.to_json() for v in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        known = {f.name for f in fields(self)}
        for name, value in state.items():
            if name in known and name not in ("seconds", "history"):
                setattr(self, name, value)
        # A checkpoint from before an accumulator existed starts that accumulator at zero.
        self.seconds = Seconds(**state.get("seconds", {}))
        self.history = [Validation.from_json(h) for h in state.get("history", [])]


@dataclass
class EarlyStopping:
    """Patience over eval.metric, and which validated step the run keeps.

    A tie (a value no worse than the best, and within min_delta of it) keeps the step whose
    `tiebreak` (the task's validation loss: log loss or RMSE) is lower. A coarse metric on a
    small validation split (accuracy on 11 rows moves in steps of 0.09) ties at every
    validation once it tops out, and the earliest of them is rarely the best model: the loss
    still tells them apart. A tie is not a gain: patience counts from the last real one."""

    patience: int
    min_delta: float
    best: float | None = None
    best_step: int | None = None
    bad_evals: int = 0
    higher_is_better: bool = True  # from the config (eval.metric), like patience
    best_tiebreak: float | None = None  # the kept step's validation loss (lower is better)

    def update(self, value: float, step: int, tiebreak: float | None = None) -> bool:
        """Record a validation value; True when the run keeps this step: a new best (by more
        than min_delta), or a tie with a lower `tiebreak`."""
        gain = (value - self.best if self.higher_is_better else self.best - value) if self.best is not None else 0.0
        if self.best is None or gain > self.min_delta:
            self.best, self.best_step, self.bad_evals, self.best_tiebreak = value, step, 0, tiebreak
            return True
        self.bad_evals += 1
        if (0.0 <= gain and tiebreak is not None and self.best_tiebreak is not None
                and tiebreak < self.best_tiebreak):
            self.best, self.best_step, self.best_tiebreak = value, step, tiebreak
            return True
        return False

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and self.bad_evals >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Patience and min_delta come from the current config; the counters from the checkpoint
        # (one written before ties were broken has no tiebreak: the next tie keeps its step).
        self.best, self.best_step, self.bad_evals = state["best"], state["best_step"], state["bad_evals"]
        self.best_tiebreak = state.get("best_tiebreak")


class _Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any, /) -> Any: ...


class TrainState:
    """The model and everything the optimisation carries, as one checkpointable unit."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, scaler: torch.amp.GradScaler,
                 stopper: EarlyStopping, progress: Progress | None = None) -> None:
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.stopper = stopper
        self.progress = progress or Progress()

    @classmethod
    def create(cls, config: RetrainConfig, schema: ModelSchema, device: torch.device, precision: str,
               higher_is_better: bool = True) -> TrainState:
        """A fresh state for `config` (the model is initialised from the current torch RNG)."""
        tc = config.train
        check_model_fits(config, schema, device)
        spec = train_spec(config.model)
        try:
            model = spec.build_model(config.model, schema).to(device)
        except (MemoryError, torch.OutOfMemoryError) as err:
            raise ConfigError(f"the model does not fit in {device.type} memory ({type(err).__name__}); lower "
                              "model.hidden, model.embedding_dim or preprocess.max_vocab") from None
        # torch implements the fused kernel for CPU and CUDA.
        optimizer = spec.build_optimizer(model, tc, tc.optim.fused and device.type in ("cpu", "cuda"))
        scheduler = spec.build_scheduler(optimizer, tc)
        # bf16 needs no GradScaler: it has fp32's exponent range. Only fp16 can underflow.
        scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
        return cls(model, optimizer, scheduler, scaler,
                   EarlyStopping(tc.patience_validations, tc.min_delta, higher_is_better=higher_is_better))

    def _parts(self) -> dict[str, _Stateful]:
        # The checkpoint's keys. "run" is the Progress (its name in every checkpoint so far).
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler,
                "scaler": self.scaler, "early_stopping": self.stopper, "run": self.progress}

    def state_dict(self, rng: RngState | None = None,
                   rng_per_rank: list[RngState] | None = None) -> dict[str, Any]:
        """The whole state; `rng` defaults to this process's generators, `rng_per_rank` (under
        DDP) holds every rank's, gathered by the caller."""
        state = {name: part.state_dict() for name, part in self._parts().items()}
        state["rng"] = rng if rng is not None else capture_rng()
        if rng_per_rank is not None:
            state["rng_per_rank"] = rng_per_rank
        return state

    def load_state_dict(self, state: dict[str, Any], rank: int = 0, world_size: int = 1) -> None:
        """Restore every part and the RNGs: each rank its own generators when the world size is
        unchanged, rank 0's for all otherwise."""
        for name, part in self._parts().items():
            part.load_state_dict(state[name])
        per_rank = state.get("rng_per_rank")
        restore_rng(per_rank[rank] if per_rank is not None and len(per_rank) == world_size else state["rng"])
