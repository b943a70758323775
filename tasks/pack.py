from __future__ import annotations

from typing import Any

from prefect import task

from tasks.policies import retry_transient, task_logger
from training.config import RetrainConfig
from training.stages import pack_stage

__all__ = ["pack_dataset"]


@task(name="pack", retries=2, retry_delay_seconds=5, retry_condition_fn=retry_transient)
def pack_dataset(config: RetrainConfig) -> dict[str, Any]:
    """Validate the source Parquet and pack it into content-addressed shards (idempotent)."""
    packed = pack_stage(config)
    verb = "reused" if packed["reused"] else "packed"
    task_logger().info("%s dataset %s: %s rows in %d shards", verb, packed["fingerprint"], packed["rows"], packed["shards"])
    return packed
