"""Batch scoring with the champion (or a chosen model): Parquet in, Parquet out."""

from __future__ import annotations

from prefect import flow

from tasks.policies import FLOW_TIMEOUTS, apply_credentials_block
from tasks.score import score_parquet
from tasks.runtime import effective_config
from training.config import RetrainConfig

__all__ = ["predict"]


@flow(name="predict", timeout_seconds=FLOW_TIMEOUTS.predict, flow_run_name="predict-{model}", log_prints=True)
def predict(
    input: str,
    output: str,
    model: str = "champion",
    key_columns: list[str] | None = None,  # not `keys`: Prefect's parameter model would shadow .keys()
    config: RetrainConfig = RetrainConfig(),  # noqa: B008 - pydantic default renders in the UI
) -> str:
    """Score the Parquet file, folder or s3:// prefix `input` with `model` into `output`; returns
    the output's path. Only the config's storage and model.factory are used: where the champion
    lives, and which factory is trusted.

    Args:
        input: The rows to score: a Parquet file, a folder of them, or an s3:// prefix.
        output: Where the scores go: a Parquet file path or an s3:// key (a rerun with the same
            input and model writes nothing).
        model: `champion` (the storage root's current champion), a promoted model's sha256, or
            a model package folder.
        key_columns: Input columns copied beside the predictions (empty: all of them).
        config: The storage root holding the champion, and the trusted model.factory.
    """
    config = effective_config(config)
    apply_credentials_block(config.storage)
    return score_parquet(config, input, output, model, key_columns).output
