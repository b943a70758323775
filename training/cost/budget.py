"""A run's spending limits (`budget.max_wall_seconds`, `max_usd`, `max_gpu_hours`) on held machine
time: the training loop asks after every step, the launcher before it starts a run that an earlier
budget stopped (a larger budget continues it from its checkpoint). Torch-free: both sides use it."""

from __future__ import annotations

from training.config import BudgetConfig

__all__ = ["BudgetLimits"]


class BudgetLimits:
    """The limits in seconds, dollars and GPU-hours of held machine time, at a machine's rate."""

    def __init__(self, config: BudgetConfig, rate_per_hour: float, gpus: int) -> None:
        self.config, self.rate, self.gpus = config, rate_per_hour, gpus
        self.active = any(v is not None for v in (config.max_wall_seconds, config.max_usd, config.max_gpu_hours))

    def exceeded(self, spent: float, per_step: float, per_eval: float, next_steps: int) -> str | None:
        """Why a limit is crossed at `spent` seconds (or, with `next_steps`, would be after that
        many more steps at `per_step` and one validation at `per_eval`); None within all."""
        if not self.active:
            return None
        projected = spent + (per_step * next_steps + per_eval if next_steps else 0.0)
        c = self.config
        checks = [
            ("budget.max_wall_seconds", c.max_wall_seconds, 1.0, "s"),
            ("budget.max_usd", c.max_usd, self.rate / 3600.0, "$"),
            ("budget.max_gpu_hours", c.max_gpu_hours, self.gpus / 3600.0, "GPU-h"),
        ]
        for key, limit, per_second, unit in checks:
            if limit is None or per_second == 0:
                continue
            if projected * per_second > limit:
                return (f"{key}={limit:g}: {spent * per_second:.4g} {unit} spent, "
                        f"{projected * per_second:.4g} {unit} after the next interval")
        return None
