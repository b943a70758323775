"""Early stopping whose whole state lives in the checkpoint, so patience survives a resume."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["EarlyStopping"]


@dataclass
class EarlyStopping:
    patience: int
    min_delta: float
    best: float | None = None
    best_step: int | None = None
    bad_evals: int = 0
    higher_is_better: bool = True  # from the config (eval.metric), like patience

    def update(self, value: float, step: int) -> bool:
        """Record a validation value; True when it is a new best (by more than min_delta)."""
        gain = (value - self.best if self.higher_is_better else self.best - value) if self.best is not None else 0.0
        if self.best is None or gain > self.min_delta:
            self.best, self.best_step, self.bad_evals = value, step, 0
            return True
        self.bad_evals += 1
        return False

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and self.bad_evals >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Patience and min_delta come from the current config; the counters from the checkpoint.
        self.best, self.best_step, self.bad_evals = state["best"], state["best_step"], state["bad_evals"]
