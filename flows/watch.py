"""Data arrival: list the source on a schedule and tell the retrain deployment what arrived."""

from __future__ import annotations

from prefect import flow

from tasks.policies import FLOW_TIMEOUTS, apply_credentials_block
from tasks.runtime import effective_config, watch_run_name
from tasks.watch import announce_arrival, look_at_source
from training.config import RetrainConfig

__all__ = ["watch"]


@flow(name="watch", timeout_seconds=FLOW_TIMEOUTS.watch, flow_run_name=watch_run_name, log_prints=True)
def watch(config: RetrainConfig = RetrainConfig()) -> list[str]:  # noqa: B008 - pydantic default renders in the UI
    """List data.source; when files arrived since the last look, emit `retrain.data.arrived`
    naming them (the retrain deployment's trigger starts a run). Returns their names.

    Args:
        config: The retrain deployment's config: its data.source is what is watched, its storage
            root remembers what was seen.
    """
    config = effective_config(config)
    apply_credentials_block(config.storage)
    arrival = look_at_source(config)
    announce_arrival(config, arrival)
    return arrival.arrived
