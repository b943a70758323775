"""What a flow run takes from Prefect's runtime: its deployment's parameters, its id and name, and
the storage root's single writer slot."""

from __future__ import annotations

import datetime
import hashlib
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from prefect import runtime

from tasks.policies import task_logger
from training.pipeline.step_times import resolve_planned_instance
from training.config import RetrainConfig, StorageConfig, merge_over
from training.errors import Preempted
from training.storage.lease import hold_root, hold_s3_root
from training.storage.root import StorageRoot, local_dir_for

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
    `planned_instance`, `cost.instance_type: auto` becomes the last plan's pick."""
    deployed = _deployment_parameters()
    merged = config
    if deployed and isinstance(deployed.get("config"), dict):  # else a direct call (CLI, tests): already whole
        merged = merge_over(deployed["config"], config)
        if merged != config:
            task_logger().info("run parameters merged over deployment %s's config", runtime.deployment.name)
    return _planned(merged) if planned_instance else merged


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
    from training.data.source_check import checked_source

    checked, inferred = checked_source(config)
    if inferred is not None:
        task_logger().info("feature columns inferred from the source's schema (put them in the deployment's config "
                           "to fix them): %s", " ".join(inferred.overrides()))
        for column, why in inferred.left_out.items():
            task_logger().info("left out column '%s': %s", column, why)
    return checked


def check_restarts(config: RetrainConfig) -> None:
    """A flow run started again (rescheduled after a reclaim, or after a crash by the shipped
    automation) resumes; past `train.retry.max_restarts` restarts it fails instead, so a run that
    keeps dying cannot be rescheduled for ever."""
    starts = int(runtime.flow_run.run_count or 1)
    if starts <= 1:
        return
    limit = config.train.retry.max_restarts
    if starts - 1 > limit:
        raise Preempted(f"this flow run was started {starts} times; train.retry.max_restarts ({limit}) allows {limit} "
                        "restarts: it is failed rather than rescheduled again (a new run resumes from its checkpoint)")
    task_logger().warning("flow run started again (restart %d of at most %d): every stage resumes from what is stored",
                          starts - 1, limit)


def flow_run_id() -> str | None:
    return runtime.flow_run.id


def flow_run_name() -> str:
    """`<data source>-<date>-<time>-<id>`, e.g. `clicks-2026-11-28-0300-3f2a`: what was trained,
    when, and which run (two runs started in the same minute differ in the flow run id's head)."""
    return run_name(runtime.flow_run.parameters or {}, runtime.deployment.parameters or {},
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


# A holder renews its lease every 45 s. One that dies (SIGKILL, a lost machine) frees the slot
# when the lease runs out, noticed by the server's repossessor within 15 s more. strict: fail
# closed if the limit cannot be read. A renewal that fails once (an API blip) must not kill hours
# of training, so it only logs.
_LEASE_SECONDS = 60.0
_FREE_WITHIN_SECONDS = 3.0  # a free slot is granted in one request


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
      when its lease lapses).
    - On this machine, for a local root, whatever server: an fcntl lock in the root, which a
      dead holder frees at once (training.storage.lease).
    - For an S3 root, whatever server and machine: a lease object written with S3's conditional
      writes, renewed while held; a dead holder's lease expires (training.storage.lease).
    """
    from prefect.concurrency.sync import concurrency

    log = task_logger()
    with ExitStack() as held:
        # An s3:// root is held by its S3 lease alone: it spans machines and servers, and a new
        # attempt of a run whose machine was lost takes it over at once, where a Prefect slot
        # held by the lost attempt would keep it waiting for the slot's lease to lapse.
        if not storage.is_s3 and _server_is_shared():
            name = writer_limit_name(storage)
            _ensure_limit(name)
            def slot(timeout_seconds: float | None = None) -> Any:
                return concurrency(name, occupy=1, strict=True, lease_duration=_LEASE_SECONDS, timeout_seconds=timeout_seconds,
                                   raise_on_lease_renewal_failure=False)

            try:
                held.enter_context(slot(_FREE_WITHIN_SECONDS))
            except TimeoutError:
                log.warning("storage root %s is in use by another run (concurrency limit %s); waiting for it. A "
                            "run that died frees it within %.0f s", storage.root, name, _LEASE_SECONDS + 15)
                held.enter_context(slot())
                log.info("storage root %s is free: going on", storage.root)
        if storage.is_s3:
            remote = StorageRoot(storage).remote
            assert remote is not None
            owner = runtime.flow_run.id
            held.enter_context(hold_s3_root(remote, on_wait=log.warning, owner=str(owner) if owner else None))
        else:
            held.enter_context(hold_root(local_dir_for(storage), on_wait=log.warning))
        yield
