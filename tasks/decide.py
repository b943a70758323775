"""The decide task: does this run have anything to learn (`train.retrain_when`)?"""

from __future__ import annotations

from prefect import task

from tasks.artifacts import publish_decision
from tasks.policies import HOUR, retried, task_logger
from training.config import RetrainConfig
from training.pipeline.decide_stage import decide_stage
from training.pipeline.handoffs import PackResult, TrainingDecision

__all__ = ["decide_training"]


@task(name="decide", **retried(timeout_seconds=HOUR))
def decide_training(config: RetrainConfig, packed: PackResult) -> TrainingDecision:
    """Drift of the new data and the champion's score on it, against train.retrain_when."""
    decision = decide_stage(config, packed)
    if decision.mode != "always":
        task_logger().info("%s: %s", "training" if decision.train else "keeping the champion", decision.reason)
        publish_decision(decision)
    return decision
