"""Data arrival on a real Prefect server and a real process worker: the shipped `watch`
deployment lists the source on its schedule, and a file that lands there starts a run of the
shipped `retrain` deployment (through its trigger), which packs that file only."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Callable

import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import small_overrides
from tests.e2e.conftest import ROOT, Deployer, PrefectServer, Worker, deployment, flow_runs_of, wait_for
from training.config import load_config

pytestmark = pytest.mark.slow


def _deploy_pair(deployer: Deployer, pool: str, config: dict, suffix: str) -> tuple[str, str]:
    """The shipped `retrain` (its trigger as shipped, paired with this watch) and `watch` (its
    schedule every 10 s instead of 15 min, turned on), under names of their own."""
    spec = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
    ships = {d["name"]: d for d in spec["deployments"]}
    watch_name, retrain_name = f"watch-{suffix}", f"retrain-{suffix}"
    (trigger,) = ships["retrain"]["triggers"]
    trigger = {**trigger, "match_related": {**trigger["match_related"], "prefect.resource.name": watch_name}}
    spec.pop("definitions", None)
    spec["deployments"] = [
        {**ships["retrain"], "name": retrain_name, "parameters": {"config": config}, "schedules": [],
         "triggers": [trigger], "work_pool": {**ships["retrain"]["work_pool"], "name": pool}},
        {**ships["watch"], "name": watch_name, "parameters": {"config": config},
         "schedules": [{**ships["watch"]["schedules"][0], "interval": 10, "active": True}],
         "work_pool": {**ships["watch"]["work_pool"], "name": pool}},
    ]
    deployer.deploy(spec, f"arrival-{suffix}")
    return retrain_name, watch_name


@pytest.mark.timeout(1500)  # above the sum of its deadlines, so that a hang reports the worker's log
def test_a_file_that_lands_starts_a_run_that_packs_only_that_file(
        prefect_server: PrefectServer, deployer: Deployer, start_worker: Callable[[str], Worker], tmp_path: Path,
        demo_source: Path) -> None:
    table = pq.read_table(demo_source)
    days = tmp_path / "days"
    days.mkdir()
    for d in range(3):
        pq.write_table(table.slice(d * 2500, 2500), days / f"day-{d}.parquet")
    source = tmp_path / "incoming"
    source.mkdir()
    for d in range(2):
        shutil.copy(days / f"day-{d}.parquet", source)
    config = load_config(overrides=small_overrides(tmp_path / "root", source) + ["train.max_steps=20"])
    pool = f"pool-{uuid.uuid4().hex[:8]}"
    prefect_server.cli("work-pool", "create", pool, "--type", "process")
    retrain_name, watch_name = _deploy_pair(deployer, pool, config.model_dump(mode="json"), uuid.uuid4().hex[:6])
    retrain_id = deployment(prefect_server, retrain_name)["id"]
    worker = start_worker(pool)

    def completed() -> list[dict]:
        return [r for r in flow_runs_of(prefect_server, retrain_id) if r["state"]["type"] == "COMPLETED"]

    def reports() -> list[dict]:
        return sorted((json.loads(p.read_text()) for p in (tmp_path / "root").glob("runs/*/reports/*.json")),
                      key=lambda r: r["pipeline_started_at"])

    watch_id = deployment(prefect_server, watch_name, flow="watch")["id"]

    def watching(on: bool) -> None:
        """The watch's schedule on or off: while a retrain run it started trains, each look would
        be a flow-run process of its own that finds nothing new."""
        with prefect_server.api() as api:
            api.patch(f"/deployments/{watch_id}", json={"paused": not on}).raise_for_status()

    # The deadlines only catch a hang; each wait ends as soon as its run exists or completes.
    try:
        wait_for(lambda: flow_runs_of(prefect_server, retrain_id), 600, "the watch's first look to start a retrain run")
        watching(False)
        wait_for(completed, 600, "the retrain run the first look started to complete")
        assert [r["stages"]["pack"]["segments_packed"] for r in reports()] == [2]
        shutil.copy(days / "day-2.parquet", source)  # new data lands
        watching(True)  # the schedule's next look finds it
        wait_for(lambda: len(flow_runs_of(prefect_server, retrain_id)) >= 2, 600,
                 "the arrival of day-2 to start a second retrain run")
        watching(False)
        wait_for(lambda: len(completed()) >= 2, 600, "the second retrain run to complete")
    except AssertionError as failed:
        states = [(r["name"], r["state"]["name"]) for r in flow_runs_of(prefect_server, retrain_id)]
        raise AssertionError(f"{failed}\nretrain runs: {states}\n{worker.log_path.read_text()[-6000:]}") from None
    finally:
        watching(False)  # no more looks
    second = reports()[1]["stages"]["pack"]
    assert second["segments"] == 3 and second["segments_packed"] == 1
    assert second["source_bytes_read"] <= 1.2 * (days / "day-2.parquet").stat().st_size
    runs = flow_runs_of(prefect_server, retrain_id)
    assert all(not r["auto_scheduled"] for r in runs)  # started by the trigger, not a schedule
