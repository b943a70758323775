"""Where a tuning study's trials report and may be pruned: the rungs, multiples of the
validation interval up to train.max_steps (full fidelity)."""

from __future__ import annotations

from training.config import RetrainConfig
from training.search_space import SpaceError

__all__ = ["FIRST_RUNG_DIVISOR", "check_rungs", "rungs"]

# The default first rung is train.max_steps / this (tune.min_resource).
FIRST_RUNG_DIVISOR = 5


def check_rungs(config: RetrainConfig) -> None:
    """The rungs fit train.eval_every and train.max_steps (a SpaceError says how not).
    train.eval_every must be resolved (`RetrainConfig.for_train_rows`)."""
    t, every, last = config.tune, config.train.validate_every, config.train.max_steps
    if t.min_resource is not None and (t.min_resource % every or t.min_resource >= last):
        raise SpaceError(f"tune.min_resource ({t.min_resource}) must be a multiple of train.eval_every ({every}) "
                         f"and below train.max_steps ({last}): a trial reports at validated steps")
    if t.pruner != "none" and len(rungs(config)) < 2:
        raise SpaceError(f"tune.pruner {t.pruner} needs at least two rungs: train.max_steps ({last}) is too short "
                         f"for train.eval_every ({every}) x tune.reduction_factor ({t.reduction_factor}); set "
                         "tune.min_resource or tune.pruner: none")


def rungs(config: RetrainConfig) -> list[int]:
    """The optimizer steps at which a tuning trial reports and may be pruned; the last is
    train.max_steps (full fidelity)."""
    t, last = config.tune, config.train.max_steps
    if t.pruner == "none":
        return [last]
    every = config.train.validate_every
    step = t.min_resource or max(every, last // FIRST_RUNG_DIVISOR // every * every)
    out = []
    while step < last:
        out.append(step)
        step *= t.reduction_factor
    return [*out, last]
