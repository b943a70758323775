"""Packing as three tasks: begin (plan or reuse), one task per part (mapped), finish (assemble).

The flow maps `pack_part` over the parts on its task runner: the default thread pool, or a
Dask/Ray runner to spread packing over a cluster. Each part holds only its own row groups.
"""

from __future__ import annotations

from typing import Any

from prefect import task

from tasks.policies import retry_transient, task_logger
from training.config import RetrainConfig
from training.stages import pack_begin, pack_finish, pack_part_stage

__all__ = ["begin_packing", "pack_part", "finish_packing"]


@task(name="pack-plan", retries=2, retry_delay_seconds=5, retry_condition_fn=retry_transient)
def begin_packing(config: RetrainConfig) -> dict[str, Any]:
    """Check storage; reuse an already packed dataset or plan the parts to pack."""
    begun = pack_begin(config)
    if begun["done"] is None:
        task_logger().info("packing %s in %d part(s)", begun["plan"]["fingerprint"], len(begun["parts"]))
    return begun


@task(name="pack-part", retries=2, retry_delay_seconds=5, retry_condition_fn=retry_transient)
def pack_part(data: dict[str, Any], plan: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    """Validate and transform one part's row groups into per-split pieces (idempotent)."""
    return pack_part_stage(data, plan, part)


@task(name="pack", retries=2, retry_delay_seconds=5, retry_condition_fn=retry_transient)
def finish_packing(config: RetrainConfig, begun: dict[str, Any], parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Write the shards from the parts, then the manifest (last); publish them to the root."""
    packed = pack_finish(config, begun, parts)
    verb = "reused" if packed["reused"] else "packed"
    task_logger().info("%s dataset %s: %s rows in %d shards", verb, packed["fingerprint"], packed["rows"], packed["shards"])
    return packed
