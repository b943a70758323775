"""Every rewrite of a run's step budget, in one place. A run trains `train.max_steps` as
configured, except:

- a warm start trains its own budget (`warm_start.warm_steps`, scaled to what is new since
  the champion) at the warm learning rate (`for_warm_start`);
- a calibration (`retrain plan`'s, a tuning study's) trains a few steps that validate and
  checkpoint once, at the end, and never stop early (`for_calibration`).

The job built from the result carries the budget (`TrainJob.max_steps`): the training process,
its events, the task's progress and log lines read it there, never the configured value.
"""

from __future__ import annotations

from training.config import RetrainConfig
from training.copies import updated

__all__ = ["for_calibration", "for_warm_start"]


def for_warm_start(config: RetrainConfig, steps: int) -> RetrainConfig:
    """`config` for a warm start of `steps` steps, at train.warm_lr_scale of its learning rate."""
    tc = config.train
    return updated(config, {"train": updated(tc, {
        "max_steps": steps, "optim": updated(tc.optim, {"lr": tc.optim.lr * tc.warm_lr_scale})})})


def for_calibration(config: RetrainConfig, steps: int) -> RetrainConfig:
    """A deep copy of `config` that trains `steps` steps, validates and checkpoints once at the
    end, and never stops early: its timings are what a calibration measures."""
    calib = config.model_copy(deep=True)
    calib.train.max_steps = steps
    calib.train.eval_every = steps
    calib.train.checkpoint.every = steps
    calib.train.patience = 0
    return calib
