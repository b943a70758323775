from __future__ import annotations

from typing import Any

from prefect import task

from tasks.artifacts import publish_promotion
from tasks.policies import retry_transient, task_logger
from training.config import RetrainConfig
from training.stages import evaluate_stage

__all__ = ["evaluate_model"]


@task(name="evaluate", retries=2, retry_delay_seconds=5, retry_condition_fn=retry_transient)
def evaluate_model(config: RetrainConfig, packed: dict[str, Any], trained: dict[str, Any]) -> dict[str, Any]:
    """Test-split metrics and the champion/challenger decision."""
    evaluation = evaluate_stage(config, packed, trained)
    publish_promotion(evaluation)
    task_logger().info("test AUC %.4f; %s", evaluation["metrics"]["auc"], evaluation["promotion"]["reason"])
    return evaluation
