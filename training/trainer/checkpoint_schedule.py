"""When to checkpoint: every N steps, every S seconds of training, or the Young/Daly optimum."""

from __future__ import annotations

import math
from typing import Any

from training.trainer.state import Progress

__all__ = ["CheckpointSchedule"]


class CheckpointSchedule:
    """Every N steps, every S seconds of training, or (`auto`) the Young/Daly optimum
    sqrt(2 * save cost * mean time between preemptions) from the measured save cost."""

    def __init__(self, mode: str, value: float, mean_seconds_between_preemptions: float) -> None:
        self.mode, self.value, self.mtbp = mode, value, mean_seconds_between_preemptions

    def interval_seconds(self, progress: Progress) -> float | None:
        if self.mode == "seconds":
            return self.value
        if self.mode == "auto" and progress.save_cost_seconds is not None:
            return math.sqrt(2.0 * progress.save_cost_seconds * self.mtbp)
        return None

    def due(self, progress: Progress) -> bool:
        if self.mode == "steps":
            return progress.step % int(self.value) == 0
        interval = self.interval_seconds(progress)
        return interval is not None and progress.seconds["train"] - progress.last_save_train_seconds >= interval

    def describe(self, progress: Progress) -> dict[str, Any]:
        return {"mode": self.mode, "steps": int(self.value) if self.mode == "steps" else None,
                "seconds": self.interval_seconds(progress), "save_cost_seconds": progress.save_cost_seconds,
                "mean_seconds_between_preemptions": self.mtbp if self.mode == "auto" else None}
