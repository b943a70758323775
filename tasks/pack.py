"""Packing as tasks: begin (list the source, plan what is missing), one task per segment
(at most `data.pack_parts` at once), finish (the dataset's manifest, retention). On a cluster
(`data.pack_cluster`) the new files' footers are read there too, by `plan_files` tasks.

The flow submits `pack_segment` for each segment on its task runner: the default thread pool, or
a Dask/Ray runner to spread packing over a cluster. A segment task reads only its own row
groups and publishes its segment to the storage root itself, so with an s3:// root and an
s3:// source the workers share no folder with the flow.
"""

from __future__ import annotations

from typing import Any, Callable

from prefect import task
from prefect.futures import PrefectFuture, as_completed

from tasks.policies import HOUR, retried, task_logger
from training.config import RetrainConfig
from training.data.ingest.packing import PLAN_THREADS, FilesPlanned
from training.data.ingest.segments import PackedSegment, SegmentPlan
from training.data.ingest.sources import SourceFile
from training.errors import ConfigError
from training.pipeline.handoffs import PackResult
from training.pipeline.pack_stage import (
    PackBegun,
    pack_begin,
    pack_finish,
    pack_segment_stage,
    plan_files_stage,
    with_planned,
)

__all__ = ["begin_packing", "plan_files", "pack_segment", "finish_packing", "pack_dataset"]


@task(name="pack-plan", **retried(timeout_seconds=2 * HOUR))
def begin_packing(config: RetrainConfig, defer_footers: bool = False) -> PackBegun:
    """Check storage; list the source; plan the segments that are not packed yet (with
    `defer_footers`, the new files' footers are left to `plan_files` on the cluster)."""
    begun = pack_begin(config, defer_footers)
    plan = begun.plan
    if plan.unread:
        task_logger().info("%d new file(s): their footers are read on the cluster; %d segment(s) packed before",
                           len(plan.unread), len(plan.ready))
    elif plan.todo:
        task_logger().info("packing %d segment(s) of %d file(s); %d segment(s) packed before", len(plan.todo),
                           len({p.file.name for p in plan.todo}), len(plan.ready))
    return begun


# No timeout, as pack-segment below.
@task(name="pack-plan-files", task_run_name="plan-{files[0].name}-and-more", **retried(None))
def plan_files(config: RetrainConfig, source: str, files: list[SourceFile]) -> FilesPlanned:
    """Read new files' footers (16 at a time) and plan their segments, where this task runs."""
    return plan_files_stage(config, source, files)


# No timeout: submitted, it runs in a worker thread of the task runner, where Prefect cannot
# interrupt it (and warns on every run); the flow's timeout bounds it.
@task(name="pack-segment", task_run_name="pack-{plan.file.name}-{plan.file_row}", **retried(None))
def pack_segment(config: RetrainConfig, plan: SegmentPlan) -> PackedSegment:
    """Validate and pack one segment's row groups; publish it to the storage root (idempotent)."""
    return pack_segment_stage(config, plan)


@task(name="pack", **retried(timeout_seconds=2 * HOUR))
def finish_packing(config: RetrainConfig, begun: PackBegun, packed: list[PackedSegment]) -> PackResult:
    """The dataset's manifest over its segments; retention of what no kept dataset lists."""
    result = pack_finish(config, begun, packed)
    verb = "reused" if result.reused else "packed"
    task_logger().info("%s dataset %s: %s rows in %d segment(s) (%d packed now), %d shards%s", verb,
                       result.fingerprint, result.rows, result.segments, result.segments_packed, result.shards,
                       f"; {result.dropped_null_labels} source rows left out for a null label (data.drop_null_labels)"
                       if result.dropped_null_labels else "")
    return result


def pack_dataset(config: RetrainConfig) -> PackResult:
    """Plan, pack the missing segments (on the flow's task runner, or the Dask cluster of
    `data.pack_cluster`, `data.pack_parts` at a time), finish: the pack stage. A segment that
    fails (bad data) fails the stage with its own error; a half-packed segment leaves nothing
    behind, and the ones already packed are kept."""
    cluster = config.data.pack_cluster
    begun = begin_packing(config, defer_footers=cluster is not None)
    if begun.done is not None:
        packed: list[PackedSegment] = []
    elif cluster is None:
        packed = _pack_in_window(begun.plan.todo, config.data.pack_parts, lambda plan: pack_segment.submit(config, plan))
    else:
        with _dask_runner(cluster) as runner:
            begun = _planned_on(runner, config, begun)
            packed = _pack_in_window(begun.plan.todo, config.data.pack_parts,
                                     lambda plan: runner.submit(pack_segment, {"config": config, "plan": plan}))
    return finish_packing(config, begun, packed)


def _planned_on(runner: Any, config: RetrainConfig, begun: PackBegun) -> PackBegun:
    """The plan with its new files' segments, planned by `plan_files` tasks on the cluster, a
    chunk of files each; their results in the files' order, so the first bad file in that order
    is the error, as when planned here."""
    files, chunk = begun.plan.unread, PLAN_THREADS
    futures = [runner.submit(plan_files, {"config": config, "source": begun.plan.source, "files": files[i:i + chunk]})
               for i in range(0, len(files), chunk)]
    try:
        planned = [future.result() for future in futures]
    except BaseException:
        for future in futures:
            future.wait()
        raise
    return with_planned(begun, planned)


def _dask_runner(address: str) -> Any:
    """prefect-dask's task runner on the cluster at `address` (its task runs are this flow
    run's, as on the flow's own runner)."""
    try:
        from prefect_dask import DaskTaskRunner
    except ImportError:
        raise ConfigError("data.pack_cluster needs prefect-dask: pip install -c constraints.txt -e '.[dask]'") from None
    return DaskTaskRunner(address=address)


def _pack_in_window(todo: list[SegmentPlan], width: int,
                    submit: Callable[[SegmentPlan], PrefectFuture[PackedSegment]]) -> list[PackedSegment]:
    """Every segment of `todo` packed, at most `width` at once: a new one starts as soon as any
    finishes, so one slow segment holds one slot, not a whole wave (with 80 workers and
    segments of uneven size, waves that wait for their slowest keep most workers idle)."""
    waiting = list(reversed(todo))
    running: set[PrefectFuture[PackedSegment]] = set()
    packed: list[PackedSegment] = []
    try:
        while waiting or running:
            while waiting and len(running) < width:
                running.add(submit(waiting.pop()))
            done = next(as_completed(list(running)))
            running.discard(done)
            packed.append(done.result())  # a failed segment raises its own error here
    except BaseException:
        for future in running:
            future.wait()  # the others finish or fail on their own; nothing half-written stays
        raise
    return packed
