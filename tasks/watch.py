"""The watch flow's tasks: a look at the source, then the event and the listing recorded."""

from __future__ import annotations

from prefect import task
from prefect.events import emit_event

from tasks.policies import retried, task_logger
from training.config import RetrainConfig
from training.pipeline.watch_stage import Arrival, remember_listing, watch_stage

__all__ = ["DATA_ARRIVED_EVENT", "announce_arrival", "look_at_source"]

# The retrain deployment's trigger listens for it (deployments/prefect.yaml): resource id
# retrain.source.<16 hex of the source>, named by the source.
DATA_ARRIVED_EVENT = "retrain.data.arrived"


@task(name="look", **retried(timeout_seconds=300))
def look_at_source(config: RetrainConfig) -> Arrival:
    """List the source (no file is read) against the last recorded listing."""
    arrival = watch_stage(config)
    task_logger().info("%s: %d file(s), %d arrived since the last look (%s)", arrival.source, len(arrival.files),
                       len(arrival.arrived), arrival.resource_id)
    return arrival


@task(name="announce", **retried(timeout_seconds=120))
def announce_arrival(config: RetrainConfig, arrival: Arrival) -> None:
    """Emit retrain.data.arrived when files arrived, then record the listing."""
    if arrival.arrived:
        emit_event(
            event=DATA_ARRIVED_EVENT,
            resource={"prefect.resource.id": arrival.resource_id, "prefect.resource.name": arrival.source},
            payload={"source": arrival.source, "files": arrival.arrived, "bytes": arrival.arrived_bytes,
                     "first_look": arrival.first_look},
        )
    remember_listing(config, arrival)
