"""What a flow run takes from Prefect's runtime: its deployment's parameters, its id and name, and
the storage root's single writer slot."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from prefect import runtime

from tasks.policies import task_logger
from training.config import RetrainConfig, StorageConfig, merge_over
from training.errors import Preempted
from training.registry.step_times import resolve_planned_instance
from training.storage.lease import hold_root, hold_s3_root
from training.storage.root import StorageRoot, local_dir_for
from tasks.root_slot import root_slot

__all__ = ["check_restarts", "effective_config", "flow_run_id", "flow_run_name", "one_writer_per_root", "writer_limit_name",
           "TEMPORARY_SERVER_ENV"]

# Set by `retrain run` to the API URL of the temporary server it started for itself: a server
# private to one CLI run runs no lease reaper, so no Prefect concurrency slot is taken there.
TEMPORARY_SERVER_ENV = "RETRAIN_TEMPORARY_PREFECT_SERVER"


def _deployment_parameters() -> dict[str, Any] | None:
    deployment_id = runtime.deployment.id
    if not deployment_id:
        return None
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return dict(client.read_deployment(deployment_id).parameters or {})


def effective_config(config: RetrainConfig, planned_instance: bool = True) -> RetrainConfig:
    """The run's config deep-merged over its deployment's: keys the run did not give keep the
    deployment's values (Prefect itself replaces the whole `config` parameter). With
    `planned_instance`, `cost.instance_type: auto` becomes the last plan's pick.

    A retry is the same run: what the first attempt took is pinned to the flow run (an artifact
    on the Prefect server, keyed by the flow run, which a writer of the storage root cannot
    touch) and every later attempt (a retry, a reschedule after a reclaim or a crash) takes it
    back, whatever the deployment or the plan say by then."""
    merged = _merged(config)
    pinned = _pinned() if int(runtime.flow_run.run_count or 1) > 1 else None
    if pinned is not None:
        began_with, effective = pinned
        if began_with != merged:
            task_logger().info("the deployment's config changed since this flow run began: this attempt keeps the "
                               "config the run began with; new runs take the change")
    else:
        effective = _planned(merged) if planned_instance else merged
        _pin(merged, effective)
        _warn_of_a_root_per_worker(effective.storage)
    check_restarts(effective)
    return effective


def _warn_of_a_root_per_worker(storage: StorageConfig) -> None:
    """A local root on a pool with several workers: each worker machine keeps its own champion,
    data and runs, and a scoring run may use another machine's champion."""
    run_id = runtime.flow_run.id
    if storage.is_s3 or not run_id or _on_a_network_filesystem(local_dir_for(storage)):
        return
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        pool = client.read_flow_run(run_id).work_pool_name
        online = [w for w in client.read_workers_for_work_pool(pool) if str(w.status).upper().endswith("ONLINE")] \
            if pool else []
    if len(online) > 1:
        task_logger().warning("storage.root %s is a folder on this worker's machine, and work pool %s has %d workers "
                              "online: each machine keeps its own champion and runs. Set storage.root to an s3:// "
                              "prefix, or to a folder every worker shares", storage.root, pool, len(online))


_SHARED_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "ceph", "glusterfs", "lustre", "gpfs", "9p", "fuse")


def _on_a_network_filesystem(path: Path) -> bool:
    """Whether `path` lies on a filesystem other machines can mount (/proc/mounts: Linux)."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return False
    resolved = str(path.expanduser().resolve())
    found = max((m for m in mounts if resolved == m[0] or resolved.startswith(m[0].rstrip("/") + "/")),
                key=lambda m: len(m[0]), default=None)
    return found is not None and found[1].split(".")[0] in _SHARED_FILESYSTEMS


def _merged(config: RetrainConfig) -> RetrainConfig:
    deployed = _deployment_parameters()
    if deployed and isinstance(deployed.get("config"), dict):  # else a direct call (CLI, tests): already whole
        merged = merge_over(deployed["config"], config)
        if merged != config:
            task_logger().info("run parameters merged over deployment %s's config", runtime.deployment.name)
        return merged
    return config


PIN_KEY = "retrain-run-config"  # the artifact holding what a flow run's first attempt took


def _pin(merged: RetrainConfig, effective: RetrainConfig) -> None:
    if not runtime.flow_run.id:
        return
    from prefect.artifacts import create_markdown_artifact

    record = {"merged": merged.model_dump(mode="json"), "effective": effective.model_dump(mode="json")}
    create_markdown_artifact(
        key=PIN_KEY, description="The config this flow run began with; its retries and reschedules take it back",
        markdown=f"```json\n{json.dumps(record, indent=1, sort_keys=True)}\n```\n")


def _pinned() -> tuple[RetrainConfig, RetrainConfig] | None:
    """(the merged config, the effective config) the flow run's first attempt pinned, or None."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    run_id = runtime.flow_run.id
    if not run_id:
        return None
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[PIN_KEY]), flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])), limit=1)
    if not found or not isinstance(found[0].data, str):
        return None
    body = found[0].data.strip().removeprefix("```json").removesuffix("```")
    record = json.loads(body)
    return RetrainConfig.model_validate(record["merged"]), RetrainConfig.model_validate(record["effective"])


def _planned(config: RetrainConfig) -> RetrainConfig:
    """`cost.instance_type: auto` made the last plan's pick (instance, market, memory variant)."""
    resolved = resolve_planned_instance(config)
    if resolved is not config:
        task_logger().info("cost.instance_type auto: the last plan's pick, %s on %s", resolved.cost.instance_type,
                           resolved.cost.market)
    return resolved


def checked_columns(config: RetrainConfig) -> RetrainConfig:
    """The source checked as `retrain run` checks it (path, label and columns), with the feature
    columns inferred from its schema when the config names none: a deployment's run started
    with only `data.source` and `data.label` trains as the CLI would, and says what it inferred
    so it can be written into the deployment's config."""
    from training.data.ingest.source_check import checked_source

    checked, inferred = checked_source(config)
    if inferred is not None:
        if inferred.task:
            task_logger().info("data.task %s: inferred from label '%s', %s", inferred.task, checked.data.label,
                               inferred.task_why)
        task_logger().info("inferred from the source (put them in the deployment's config to fix them): %s",
                           " ".join(inferred.overrides()))
        for column, why in inferred.left_out.items():
            task_logger().info("left out column '%s': %s", column, why)
        for note in inferred.notes:
            task_logger().info("%s", note)
    return checked


def check_restarts(config: RetrainConfig) -> None:
    """A flow run started again (rescheduled after a reclaim, or after a crash by the shipped
    automation) resumes; past `train.retry.max_restarts` restarts it fails instead, so a run that
    keeps dying cannot be rescheduled for ever. Task runs a killed attempt left Running are
    closed first: nothing else would ever end them."""
    starts = int(runtime.flow_run.run_count or 1)
    if starts <= 1:
        return
    _close_orphaned_task_runs()
    limit = config.train.retry.max_restarts
    if starts - 1 > limit:
        raise Preempted(f"this flow run was started {starts} times; train.retry.max_restarts ({limit}) allows {limit} "
                        "restarts: it is failed rather than rescheduled again (a new run resumes from its checkpoint)")
    task_logger().warning("flow run started again (restart %d of at most %d): every stage resumes from what is stored",
                          starts - 1, limit)


def _close_orphaned_task_runs() -> None:
    """Crash the task runs of this flow run still Running: their attempt's process was killed
    (SIGKILL, a lost machine) before it could report them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    run_id = runtime.flow_run.id
    with get_client(sync_client=True) as client:
        orphans = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])),
            task_run_filter=TaskRunFilter(state=TaskRunFilterState(type=TaskRunFilterStateType(any_=[StateType.RUNNING]))))
        for orphan in orphans:
            client.set_task_run_state(orphan.id, Crashed(message="its attempt's process was killed before it could report; "
                                                         "the flow run's next attempt resumes from what is stored"),
                                      force=True)
            task_logger().info("task run %s of a killed attempt closed as Crashed", orphan.name)


def flow_run_id() -> str | None:
    return runtime.flow_run.id


def flow_run_name() -> str:
    """`<data source>-<date>-<time>-<id>`, e.g. `clicks-2026-11-28-0300-3f2a`: what was trained,
    when, and which run (two runs started in the same minute differ in the flow run id's head)."""
    # Not runtime.deployment.parameters: that is the flow run's own parameters again.
    return run_name(runtime.flow_run.parameters or {}, _deployment_parameters() or {},
                    runtime.flow_run.name, str(runtime.flow_run.id or ""),
                    datetime.datetime.now(datetime.timezone.utc))


def watch_run_name() -> str:
    return _prefixed("watch")


def plan_run_name() -> str:
    return _prefixed("plan")


def _prefixed(kind: str) -> str:
    name = flow_run_name()
    return name if name.startswith(f"{kind}-") else f"{kind}-{name}"


def run_name(params: dict[str, Any], deployment_params: dict[str, Any], existing: str | None, run_id: str,
             now: datetime.datetime) -> str:
    """`flow_run_name` from its inputs. The source is the run's own config's, else its
    deployment's (a run's parameters override the deployment's key by key, so a run that only
    changes train.max_steps still trains the deployment's source). A rescheduled run keeps the
    name it started with: Prefect asks again at every start."""
    suffix = f"-{run_id[:4] or 'local'}"
    if existing and run_id and existing.endswith(suffix) and existing.count("-") >= 4:
        return existing
    source = _source_of(params.get("config")) or _source_of(deployment_params.get("config"))
    stem = Path(str(source).rstrip("/")).stem if source else "demo"
    return f"{stem}-{now:%Y-%m-%d-%H%M}{suffix}"


def _source_of(config: Any) -> str | None:
    if isinstance(config, RetrainConfig):
        return config.data.source
    if isinstance(config, dict):
        return (config.get("data") or {}).get("source")
    return None


def writer_limit_name(storage: StorageConfig) -> str:
    """One global concurrency limit per storage root, whichever deployment or CLI uses it."""
    root = storage.root if storage.is_s3 else str(Path(storage.root).expanduser().resolve())
    return "retrain-root-" + hashlib.sha256(root.encode()).hexdigest()[:16]


def _ensure_limit(name: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            existing = client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            try:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
            except ObjectAlreadyExists:
                pass  # another run created it a moment ago
            return
        if existing.limit != 1:
            task_logger().warning("global concurrency limit %s allows %d runs at once; set it to 1 so that "
                                  "runs on one storage root cannot overlap", name, existing.limit)


def _server_is_shared() -> bool:
    """False for a temporary server of a lone CLI run (Prefect's in-process one, or the one
    `retrain run` starts): it runs no lease reaper, so a slot held by a killed run would never
    come free there."""
    from prefect.client.base import ServerType
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        if client.server_type is ServerType.EPHEMERAL:
            return False
        private = os.environ.get(TEMPORARY_SERVER_ENV)
        return not private or str(client.api_url).rstrip("/") != private.rstrip("/")


@contextmanager
def one_writer_per_root(storage: StorageConfig) -> Iterator[None]:
    """Hold the root while packing, training, evaluating and promoting: a second run on the same
    root waits until the first is done.

    - Across machines and deployments on a shared Prefect server, for a local root (a shared
      filesystem): the global concurrency limit named after the root (a dead holder frees it
      when its lease lapses, or its flow run's next attempt at once: tasks.root_slot).
    - On this machine, for a local root, whatever server: an fcntl lock in the root, which a
      dead holder frees at once (training.storage.lease).
    - For an S3 root, whatever server and machine: a lease object written with S3's conditional
      writes, renewed while held; a dead holder's lease expires (training.storage.lease).
    """
    log = task_logger()
    with ExitStack() as held:
        # An s3:// root is held by its S3 lease alone: it spans machines and servers, and a new
        # attempt of a run whose machine was lost takes it over at once, where a Prefect slot
        # held by the lost attempt would keep it waiting for the slot's lease to lapse.
        if not storage.is_s3 and _server_is_shared():
            name = writer_limit_name(storage)
            _ensure_limit(name)
            held.enter_context(root_slot(name, storage.root))
        if storage.is_s3:
            remote = StorageRoot(storage).remote
            assert remote is not None
            owner = runtime.flow_run.id
            held.enter_context(hold_s3_root(remote, on_wait=log.warning, owner=str(owner) if owner else None))
        else:
            held.enter_context(hold_root(local_dir_for(storage), on_wait=log.warning))
        yield
