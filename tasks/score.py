from __future__ import annotations

from prefect import task

from tasks.policies import HOUR, retried, task_logger
from training.config import RetrainConfig
from training.model.predict_result import PredictResult

__all__ = ["score_parquet"]


@task(name="score", **retried(timeout_seconds=12 * HOUR))
def score_parquet(config: RetrainConfig, source: str, output: str, model: str, key_columns: list[str] | None
                  ) -> PredictResult:
    """Score `source` into `output`; a retry (or a rerun) finds finished output and skips it.
    (Not `keys`: Prefect's parameter model would shadow its .keys().)"""
    from training.pipeline.predict_stage import nothing_to_score, predict_stage  # torch: only when it scores

    empty = nothing_to_score(source)
    if empty is not None:
        task_logger().warning("%s: nothing to score; this run does nothing (put Parquet files there, or set the "
                              "deployment's `input` parameter)", empty)
        return PredictResult(output=output, rows=0, model_sha256="", skipped=True, seconds=0.0,
                             key_columns=key_columns or [])
    result = predict_stage(config, source, output, model, key_columns)
    task_logger().info("%s %d rows with model %s -> %s", "already scored:" if result.skipped else "scored",
                       result.rows, result.model_sha256[:12], result.output)
    return result
