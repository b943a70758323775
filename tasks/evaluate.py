from __future__ import annotations

from prefect import task

from tasks.artifacts import publish_promotion
from tasks.policies import retry_transient, task_logger
from training.config import RetrainConfig
from training.pipeline.evaluate_stage import champion_validation_metric, evaluate_stage
from training.pipeline.handoffs import Evaluation, PackResult
from training.launch.results import TrainResult

__all__ = ["evaluate_model", "score_champion"]


@task(name="evaluate", retries=2, retry_delay_seconds=5, retry_condition_fn=retry_transient)
def evaluate_model(config: RetrainConfig, packed: PackResult, trained: TrainResult) -> Evaluation:
    """Test-split metrics and the champion/challenger decision."""
    evaluation = evaluate_stage(config, packed, trained)
    publish_promotion(evaluation)
    # The reason names the test metric and what it was compared with: said once.
    task_logger().info("%s: %s", "promoted" if evaluation.promotion.promoted else "champion kept",
                       evaluation.promotion.reason)
    return evaluation


@task(name="champion-baseline", retries=2, retry_delay_seconds=5, retry_condition_fn=retry_transient)
def score_champion(config: RetrainConfig, packed: PackResult) -> float | None:
    """The champion's validation eval.metric on this dataset: the bar the champion gate holds training to."""
    value = champion_validation_metric(config, packed)
    task_logger().info("champion gate: %s", "no usable champion to beat" if value is None
                       else f"the champion's validation {config.eval.metric or 'metric'} is {value:.4f}")
    return value
