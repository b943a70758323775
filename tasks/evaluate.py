from __future__ import annotations

from prefect import task

from tasks.artifacts import publish_promotion
from tasks.policies import HOUR, forward_child_event, retried, task_logger
from training.config import RetrainConfig
from training.pipeline.handoffs import Evaluation, PackResult
from training.pipeline.stage_calls import champion_metric_in_child, evaluate_in_child
from training.protocol.events import ChildEvent
from training.protocol.results import TrainResult

__all__ = ["evaluate_model", "score_champion"]


@task(name="evaluate", **retried(timeout_seconds=4 * HOUR))
def evaluate_model(config: RetrainConfig, packed: PackResult, trained: TrainResult) -> Evaluation:
    """Test-split metrics and the champion/challenger decision, in a child process (scoring and
    export need torch; this process need not import it)."""
    evaluation = evaluate_in_child(config, packed, trained, _to_run_log)
    publish_promotion(evaluation)
    # The reason names the test metric and what it was compared with: said once.
    task_logger().info("%s: %s", "promoted" if evaluation.promotion.promoted else "champion kept",
                       evaluation.promotion.reason)
    return evaluation


@task(name="champion-baseline", **retried(timeout_seconds=4 * HOUR))
def score_champion(config: RetrainConfig, packed: PackResult) -> float | None:
    """The champion's validation eval.metric on this dataset: the bar the champion gate holds training to."""
    value = champion_metric_in_child(config, packed, _to_run_log)
    task_logger().info("champion gate: %s", "no usable champion to beat" if value is None
                       else f"the champion's validation {config.eval.metric or 'metric'} is {value:.4f}")
    return value


def _to_run_log(event: ChildEvent) -> None:
    forward_child_event(task_logger(), event)
