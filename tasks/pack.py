"""Packing as three tasks: begin (plan or reuse), one task per part (mapped), finish (assemble).

The flow maps `pack_part` over the parts on its task runner: the default thread pool, or a
Dask/Ray runner to spread packing over a cluster. Each part holds only its own row groups.
"""

from __future__ import annotations


from prefect import task, unmapped

from tasks.policies import retry_transient, task_logger
from training.config import DataConfig, RetrainConfig
from training.data.packing import PackedPart, PackPart, PackPlan, abandon_pack
from training.pipeline.handoffs import PackResult
from training.pipeline.pack_stage import PackBegun, pack_begin, pack_finish, pack_part_stage

__all__ = ["begin_packing", "pack_part", "finish_packing", "pack_dataset"]


@task(name="pack-plan", retries=2, retry_delay_seconds=5, retry_condition_fn=retry_transient)
def begin_packing(config: RetrainConfig) -> PackBegun:
    """Check storage; reuse an already packed dataset or plan the parts to pack."""
    begun = pack_begin(config)
    if begun.plan is not None:
        task_logger().info("packing %s in %d part(s)", begun.plan.fingerprint, len(begun.plan.parts))
    return begun


@task(name="pack-part", task_run_name="pack-part-{part.index}", retries=2, retry_delay_seconds=5,
      retry_condition_fn=retry_transient)
def pack_part(data: DataConfig, plan: PackPlan, part: PackPart) -> PackedPart:
    """Validate and transform one part's row groups into per-split pieces (idempotent)."""
    return pack_part_stage(data, plan, part)


@task(name="pack", retries=2, retry_delay_seconds=5, retry_condition_fn=retry_transient)
def finish_packing(config: RetrainConfig, begun: PackBegun, parts: list[PackedPart]) -> PackResult:
    """Write the shards from the parts, then the manifest (last); publish them to the root."""
    packed = pack_finish(config, begun, parts)
    verb = "reused" if packed.reused else "packed"
    task_logger().info("%s dataset %s: %s rows in %d shards", verb, packed.fingerprint, packed.rows, packed.shards)
    return packed


def pack_dataset(config: RetrainConfig) -> PackResult:
    """Plan, pack the parts (mapped over the flow's task runner), assemble: the pack stage.

    A part that fails (bad data found while packing) fails the whole stage with its own error,
    and the half-written dataset folder is removed: nothing of this attempt is left behind.
    """
    begun = begin_packing(config)
    plan = begun.plan
    futures = pack_part.map(unmapped(config.data), unmapped(plan), plan.parts if plan is not None else [])
    try:
        # Resolve every part here: a failed upstream would otherwise leave `finish_packing`
        # NotReady and the flow holding None.
        parts = [future.result() for future in futures]
    except BaseException:
        futures.wait()  # the other parts must stop writing before their folder goes
        if plan is not None:
            abandon_pack(plan)
        raise
    return finish_packing(config, begun, parts)
