"""When a run stops before `train.max_steps`, and why: the stopping policy in one place.

- a stop request (SIGTERM, a spot notice) is a `StopFlag`, checked after each optimizer step;
- budgets (`budget.max_wall_seconds`, `max_usd`, `max_gpu_hours`) on held machine time;
- the plateau (early stopping's patience);
- the champion gate: a run that cannot beat the champion by `eval.min_delta` stops early;
- under DDP, one tiny all-reduce per step makes every rank act on the same decision.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from training.config import BudgetConfig, RetrainConfig, metric_name
from training.cost.budget import BudgetLimits
from training.protocol.results import Validation
from training.trainer.state import EarlyStopping, Progress

__all__ = ["Budget", "CONTINUE", "Decision", "STATUSES", "StopFlag", "StopPolicy", "agree_across_ranks", "champion_gate"]

STATUSES = ("completed", "budget_stopped", "early_stopped")  # "completed": not stopped early


class StopFlag:
    """Set from a signal handler or the spot-notice poller; checked after each optimizer step."""

    def __init__(self) -> None:
        self.reason: str | None = None

    def request(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    @property
    def requested(self) -> bool:
        return self.reason is not None


class Budget:
    """The run's spending limits (`training.cost.budget`), asked with the run's progress."""

    def __init__(self, config: BudgetConfig, rate_per_hour: float, gpus: int) -> None:
        self.limits = BudgetLimits(config, rate_per_hour, gpus)
        self.active = self.limits.active

    def exceeded(self, progress: Progress, next_steps: int) -> str | None:
        """Why a limit is (or, after `next_steps` more steps and a validation, would be) crossed."""
        if not self.active:
            return None  # checked every step: no work when there is nothing to check
        seconds = progress.seconds
        per_step = (seconds.train + seconds.checkpoint) / max(1, progress.step)
        per_eval = seconds.eval / max(1, len(progress.history))
        return self.limits.exceeded(progress.billed_seconds(), per_step, per_eval, next_steps)


def champion_gate(history: list[Validation], champion_value: float | None, min_delta: float,
                  max_steps: int, metric: str = "auc", higher_is_better: bool = True) -> str | None:
    """Stop when even an optimistic linear extrapolation of the last three validations cannot
    reach the champion's validation metric improved by min_delta by max_steps."""
    if champion_value is None or len(history) < 3:
        return None
    sign = 1.0 if higher_is_better else -1.0  # the extrapolation runs on "higher is better" scores
    recent = history[-3:]
    steps = np.array([v.step for v in recent], dtype=np.float64)
    scores = sign * np.array([v[metric] for v in recent], dtype=np.float64)
    slope = float(np.polyfit(steps, scores, 1)[0])
    best = max(sign * v[metric] for v in history)
    reachable = best + max(0.0, slope) * (max_steps - steps[-1])
    needed = sign * champion_value + min_delta
    if reachable < needed:
        return (f"champion gate: validation {metric_name(metric)} trend reaches at {'most' if sign > 0 else 'least'} "
                f"{sign * reachable:.4f} by step {max_steps}, the champion needs {sign * needed:.4f}")
    return None


@dataclass(frozen=True)
class Decision:
    """What the policy decided after a step. `validate_first`: stopping on a step that was not
    validated, so the model must be validated before the run ends (the best must be known)."""

    status: str = "completed"
    reason: str | None = None
    validate_first: bool = False


CONTINUE = Decision()  # the answer on almost every step: one shared object, none built per step


class StopPolicy:
    """Budgets, plateau and champion gate, decided on rank 0 after each step."""

    def __init__(self, config: RetrainConfig, rate_per_hour: float, gpus: int,
                 champion_value: float | None, metric: str = "auc", higher_is_better: bool = True) -> None:
        self.budget = Budget(config.budget, rate_per_hour, gpus)
        self.train, self.gate = config.train, config.budget.champion_gate
        self.min_delta_vs_champion = config.eval.min_delta
        self.champion_value = champion_value
        self.metric, self.higher_is_better = metric, higher_is_better

    def decide(self, progress: Progress, stopper: EarlyStopping, validated: bool) -> Decision:
        tc = self.train
        if progress.step >= tc.max_steps:
            return CONTINUE  # it reached train.max_steps: completed, whatever would have stopped it next
        # Budgets: at a validation, stop if the next interval would cross a limit; at any step,
        # stop once a limit is crossed (a step far slower than the average so far).
        over = self.budget.exceeded(progress, tc.validate_every if validated else 0)
        if over is not None:
            return Decision("budget_stopped", over, validate_first=not validated)
        if not validated:
            return CONTINUE
        if stopper.should_stop:
            return Decision("early_stopped", f"no validation {metric_name(self.metric)} gain > {tc.min_delta} in {tc.patience_validations} validations")
        if self.gate:
            gated = champion_gate(progress.history, self.champion_value, self.min_delta_vs_champion, tc.max_steps,
                                  self.metric, self.higher_is_better)
            if gated is not None:
                return Decision("early_stopped", gated)
        return CONTINUE


def agree_across_ranks(stop_requested: bool, status: str, save_now: bool, rank: int,
                       device: torch.device, k: int = 1) -> tuple[bool, str, bool, int]:
    """(stop requested anywhere, rank 0's status, rank 0's save decision, rank 0's steps for
    the next block) on every rank.

    Rank 0 decides (validation, budgets, time-based schedules and the block length are its
    alone); every rank contributes its stop request. One tiny all-reduce per block keeps them in
    step. The flags live on the training device: nccl all-reduces CUDA tensors only, gloo either."""
    import torch.distributed as dist

    leader = rank == 0
    flags = torch.tensor([int(stop_requested), STATUSES.index(status) if leader else 0, int(save_now and leader),
                          k if leader else 0], dtype=torch.int64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    stop, agreed, save, block = flags.tolist()  # one device-to-host copy, not four
    return bool(stop), STATUSES[int(agreed)], bool(save), int(block)
