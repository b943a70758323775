"""A spot reclaim as ECS and Kubernetes do it, on one machine: the shipped image and docker
deployment, a real docker worker, moto's S3 server as the storage root.

One run, reclaimed twice:
- `docker stop -t 30` mid-training (SIGTERM, a grace, SIGKILL): the emergency checkpoint reaches
  S3, the run goes AwaitingRetry, the worker starts a new container with an empty disk, and it
  resumes from S3.
- then `docker kill` of that container (no signal to act on, as when a node vanishes): the worker
  reports the run Crashed, the shipped automation reschedules it, and a third container resumes
  from the last periodic checkpoint, to the weights of a run that was never interrupted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import pytest

from tests.containers.conftest import Deployed, image_bytes
from tests.containers.spot import RunOnS3, containers_of, docker, first_resumed_step_after, watch_heartbeat
from tests.e2e.conftest import PrefectServer, Worker, deployment, flow_run, wait_for
from training.config import load_config

pytestmark = [pytest.mark.container, pytest.mark.slow]

RESULTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "containers.json"


def _overrides(endpoint: str, bucket: str, prefix: str) -> list[str]:
    # The built-in demo data (generated in each new container from its seed, byte for byte),
    # trained long enough that the reclaim lands while it trains, whatever the machine's load.
    return [f"storage.root=s3://{bucket}/{prefix}", f"storage.endpoint_url={endpoint}", "storage.heartbeat_seconds=0.2",
            "storage.multipart_mb=5", "train.max_steps=2000", "train.eval_every=1000", "train.checkpoint.every=50",
            "train.batch_size=128", "train.schedule.warmup_steps=5", "train.patience=0", "train.retry.delay_seconds=0",
            "train.loader.num_workers=0", "train.loader.torch_threads=1", "model.hidden=[32, 16]", "model.embedding_dim=4"]


def _reference_sha(endpoint: str, bucket: str) -> str:
    """The same config trained here without interruption, under a prefix of its own."""
    from training.pipeline.pack_stage import pack_stage
    from training.pipeline.preprocess_stage import preprocess_stage
    from training.pipeline.train_stage import train_stage
    from training.registry.champion import champion_of

    config = load_config(overrides=_overrides(endpoint, bucket, "reference"))
    packed = pack_stage(config)
    prep = preprocess_stage(packed.dataset_dir, config.preprocess, config.storage)
    return train_stage(config, packed, prep, champion_of(config)).model.sha256


def _run(server: PrefectServer, name: str) -> str:
    with server.api() as api:
        dep = deployment(server, name)
        response = api.post(f"/deployments/{dep['id']}/create_flow_run", json={})
        response.raise_for_status()
        return str(response.json()["id"])


def _final(server: PrefectServer, run_id: str, worker: Worker, timeout: float) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        run = flow_run(server, run_id)
        return run if run["state"]["type"] in ("COMPLETED", "FAILED", "CANCELLED") else None

    try:
        run = wait_for(done, timeout, f"flow run {run_id} to finish", 2)
    except AssertionError:
        raise AssertionError(_story(server, run_id, worker)) from None
    assert run["state"]["type"] == "COMPLETED", _story(server, run_id, worker)
    return run


def _story(server: PrefectServer, run_id: str, worker: Worker) -> str:
    """What to read when a run did not complete: its states, what the automations did, and the
    worker's log (with the containers' output)."""
    with server.api() as api:
        states = api.get("/flow_run_states/", params={"flow_run_id": run_id}).json()
        since = {"since": min((s["timestamp"] for s in states), default="2000-01-01T00:00:00Z")}
        events = [e for selection in ({"resource": {"id": [f"prefect.flow-run.{run_id}"]},
                                       "event": {"exclude_prefix": ["prefect.flow-run.heartbeat"]}},
                                      {"event": {"prefix": ["prefect.automation."]}})
                  for e in api.post("/events/filter", json={"filter": {**selection, "occurred": since}, "limit": 50})
                  .json().get("events", [])]
    lines = [f"{s['timestamp']} {s['type']}/{s['name']}: {s.get('message') or ''}"
             for s in sorted(states, key=lambda s: s["timestamp"])]
    lines += [f"{e['occurred']} event {e['event']} {e['resource'].get('prefect.resource.id')}"
              for e in sorted(events, key=lambda e: e["occurred"])]
    return "\n".join(lines) + "\n" + worker.log_path.read_text()[-6000:]


def _record(key: str, value: Any) -> None:
    RESULTS.parent.mkdir(exist_ok=True)
    found = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    RESULTS.write_text(json.dumps({**found, key: value}, indent=1, sort_keys=True))


def _state_names(server: PrefectServer, run_id: str) -> list[str]:
    with server.api() as api:
        states = api.get("/flow_run_states/", params={"flow_run_id": run_id}).json()
    return [s["name"] for s in sorted(states, key=lambda s: s["timestamp"])]


def _running_other_than(run_id: str, gone: list[str]) -> list[dict[str, Any]]:
    return [c for c in containers_of(run_id) if c["running"] and c["id"] not in gone]


@pytest.mark.timeout(3600)
def test_a_stopped_then_a_killed_container_each_resume_from_s3_in_a_new_one(
        prefect_server: PrefectServer, deployed_image: Deployed, start_worker: Callable[[str], Worker],
        s3_server: str, s3_bucket: str) -> None:
    """One run reclaimed twice: its first container stopped, the next one killed, each while it
    trains; a third container finishes it to the weights of a run that was never interrupted."""
    installed = subprocess.run([sys.executable, "-m", "retrain_cli.main", "automations"], env=prefect_server.env,
                               cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=120)
    assert installed.returncode == 0, installed.stderr[-2000:]
    assert "automation retrain-reschedule-crashed-runs" in installed.stdout
    prefix = f"spot-{uuid.uuid4().hex[:6]}"
    config = load_config(overrides=_overrides(s3_server, s3_bucket, prefix)).model_dump(mode="json")
    name = deployed_image.deploy(f"retrain-{prefix}", config)
    run = RunOnS3(s3_server, s3_bucket, prefix)
    samples: list[tuple[float, int]] = []
    finished = threading.Event()
    watcher = threading.Thread(target=watch_heartbeat, args=(run, finished.is_set, samples), daemon=True)
    run_id = _run(prefect_server, name)
    worker = start_worker(deployed_image.pool)
    watcher.start()
    try:
        wait_for(lambda: len(run.complete_checkpoints()) >= 2, 600, "two checkpoints on S3", 0.2)
        (first,) = wait_for(lambda: _running_other_than(run_id, []), 300, "the flow run's container")
        stopped_at = time.time()
        docker("stop", "-t", "30", first["id"], timeout=120)
        # The worker starts a new container; it is killed once it has checkpointed twice itself.
        (second,) = wait_for(lambda: _running_other_than(run_id, [first["id"]]), 600, "a second container")
        reached = max(run.complete_checkpoints())
        wait_for(lambda: len([s for s in run.complete_checkpoints() if s > reached]) >= 2, 600,
                 "two checkpoints of the second container on S3", 0.2)
        killed_at = time.time()
        docker("kill", second["id"], timeout=60)
        _final(prefect_server, run_id, worker, 900)
    finally:
        finished.set()
        watcher.join(5)
    containers = containers_of(run_id)
    assert [c["id"] for c in containers[:2]] == [first["id"], second["id"]] and len(containers) >= 3
    # docker stop: it went by itself, within the grace (no SIGKILL); docker kill: nothing ran after it.
    assert [c["exit_code"] for c in containers[:2]] == [0, 137]
    names = _state_names(prefect_server, run_id)
    # The stop: AwaitingRetry, and no crash; the kill: Crashed, then the automation acts once: one
    # reschedule and the worker's Pending (a second AwaitingRetry there would take the resumed
    # container's concurrency slot away).
    assert "AwaitingRetry" in names[:names.index("Crashed")], names
    assert names[names.index("Crashed") + 1:][:2] == ["AwaitingRetry", "Pending"] and names.count("Crashed") == 1, names
    report = run.json("/report.json")
    assert report is not None
    assert report["preemptions"] == 2 and report["status"] == "completed" and report["steps"] == 2000
    after_stop, after_kill = report["resumed_from_steps"]
    # The stop's emergency checkpoint is where it stopped (no step lost); the kill's resume is a
    # periodic one.
    assert 0 < after_stop <= reached and after_kill % 50 == 0 and after_kill > reached
    (ledger,) = [k for k in run.keys("runs/") if k.endswith("/attempts.jsonl")]
    attempts = [json.loads(line) for line in
                run.s3.get_object(Bucket=s3_bucket, Key=ledger)["Body"].read().decode().splitlines() if line.strip()]
    assert [(a["resumed_from"], a["steps_lost"]) for a in attempts[1:2]] == [(after_stop, 0)], attempts
    assert report["model"]["sha256"] == _reference_sha(s3_server, s3_bucket)
    assert deployed_image.image is not None
    _record("image", {"name": deployed_image.image, "bytes": image_bytes(deployed_image.image)})
    _record("stop_to_first_resumed_step_seconds", first_resumed_step_after(samples, stopped_at, after_stop))
    _record("kill_to_first_resumed_step_seconds", first_resumed_step_after(samples, killed_at, after_kill))
