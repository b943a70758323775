"""Deployed runs on a real Prefect server and real process workers, each in a folder of its own
(the flow's code comes from the deployments' git_clone pull step): schedules that really create
runs, partial parameter overrides, one writer per storage root, and a SIGTERM'd run that comes
back by itself."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import pytest

from tests.conftest import small_overrides
from tests.e2e.conftest import Deployer, PrefectServer, Worker, deployment, flow_run, flow_runs_of, wait_for
from training.config import load_config

pytestmark = pytest.mark.slow

SCHEDULER_ERRORS = ("Can't evaluate bulk DML", "InvalidRequestError")


def _pool(server: PrefectServer) -> str:
    name = f"pool-{uuid.uuid4().hex[:8]}"  # its own pool: no other test's worker takes these runs
    server.cli("work-pool", "create", name, "--type", "process")
    return name


def _small(root: Path, source: Path, *extra: str) -> dict:
    return load_config(overrides=small_overrides(root, source) + list(extra)).model_dump(mode="json")


def _run(server: PrefectServer, name: str, params: dict) -> str:
    with server.api() as api:
        dep = deployment(server, name)
        response = api.post(f"/deployments/{dep['id']}/create_flow_run", json={"parameters": params})
        response.raise_for_status()
        return response.json()["id"]


def _state(server: PrefectServer, run_id: str) -> str:
    return flow_run(server, run_id)["state"]["type"]


def _wait_final(server: PrefectServer, run_id: str, timeout: float, worker: Worker) -> dict:
    def final() -> dict | None:
        run = flow_run(server, run_id)
        return run if run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") else None

    try:
        run = wait_for(final, timeout, f"flow run {run_id} to finish")
    except AssertionError:
        raise AssertionError(f"{flow_run(server, run_id)['state']}\n{worker.log_path.read_text()[-4000:]}") from None
    assert run["state"]["type"] == "COMPLETED", f"{run['state']}\n{worker.log_path.read_text()[-4000:]}"
    return run


def _pause(server: PrefectServer, deployment_id: str) -> bool:
    with server.api() as api:
        response = api.patch(f"/deployments/{deployment_id}", json={"paused": True})
    if response.status_code == 503:
        return False
    response.raise_for_status()
    return True


INTERVAL_ANCHOR = datetime(2026, 1, 1, 0, 0, 7, tzinfo=timezone.utc)  # every 10 s from :07, never :00
INTERVAL_SECONDS = {7, 17, 27, 37, 47, 57}


def test_the_server_creates_scheduled_runs_and_a_worker_completes_one(
        deployed: PrefectServer, deployer: Deployer, start_worker: Callable[[str], Worker], tmp_path: Path,
        demo_source: Path) -> None:
    pool = _pool(deployed)
    # The repo's deployment with an every-minute cron in the same explicit timezone, and a
    # 10-second interval off the whole minute: the worker completes whichever run comes first,
    # so the test does not wait up to a minute for the cron's next whole minute.
    deployer.variant("retrain-every-minute", _small(tmp_path / "root", demo_source, "train.max_steps=20"), pool,
                     schedules=[{"cron": "* * * * *", "timezone": "Europe/Berlin", "active": True},
                                {"interval": 10, "anchor_date": INTERVAL_ANCHOR.isoformat(), "timezone": "UTC",
                                 "active": True}])
    dep = deployment(deployed, "retrain-every-minute")

    def of_both_schedules() -> list[dict] | None:
        runs = flow_runs_of(deployed, dep["id"])
        seconds = {datetime.fromisoformat(r["expected_start_time"]).second for r in runs}
        return runs if 0 in seconds and seconds & INTERVAL_SECONDS else None

    # Nobody creates runs here but the server's scheduler.
    runs = wait_for(of_both_schedules, 150, "the scheduler to create flow runs of both schedules", 1)
    assert all(r["state"]["type"] == "SCHEDULED" and r["auto_scheduled"] for r in runs)
    seconds = {datetime.fromisoformat(r["expected_start_time"]).second for r in runs}
    assert seconds <= {0} | INTERVAL_SECONDS  # on the minute as the cron says, or on the interval
    # Scoring after retraining, as shipped: a run the scheduler created must set it off at
    # once, not after the triggers service's 15-minute look-back. (Its pool has no worker: the
    # run it creates is what is checked.)
    predict = deployer.predict_after("retrain-every-minute", _pool(deployed), _small(tmp_path / "root", demo_source),
                                     str(demo_source), str(tmp_path / "scores.parquet"))
    worker = start_worker(pool)

    def one_completed() -> dict | None:
        done = [r for r in flow_runs_of(deployed, dep["id"]) if r["state"]["type"] == "COMPLETED"]
        return done[0] if done else None

    try:  # whichever scheduled run the worker (and the deployment's concurrency limit of 1) runs first
        finished = wait_for(one_completed, 300, "a scheduled run to complete")
    except AssertionError:
        raise AssertionError(worker.log_path.read_text()[-4000:]) from None
    assert finished["auto_scheduled"]
    # Stop it scheduling more (the worker would run the next due run while the test waits
    # below). Under the suite's load the server can be busy for a moment (it answered 503 once),
    # which is not what this test is about: try a few times.
    wait_for(lambda: _pause(deployed, dep["id"]), 180, "the server to pause the deployment")
    scoring = wait_for(lambda: flow_runs_of(deployed, deployment(deployed, predict, flow="predict")["id"]), 300,
                       "the predict run that the completed scheduled run triggers")
    assert scoring
    log = deployed.log_path.read_text()
    assert not [e for e in SCHEDULER_ERRORS if e in log], log[-3000:]


def _train_interval(server: PrefectServer, run_id: str) -> tuple[datetime, datetime]:
    with server.api() as api:
        response = api.post("/task_runs/filter", json={"flow_runs": {"id": {"any_": [run_id]}}})
        response.raise_for_status()
    (train,) = [t for t in response.json() if t["task_key"].startswith("train") or t["name"].startswith("train-")]
    return datetime.fromisoformat(train["start_time"]), datetime.fromisoformat(train["end_time"])


def test_two_deployments_on_one_root_never_train_at_once(
        deployed: PrefectServer, deployer: Deployer, start_worker: Callable[[str], Worker], tmp_path: Path,
        demo_source: Path) -> None:
    pool = _pool(deployed)
    root = tmp_path / "shared-root"
    deployer.variant("retrain-a", _small(root, demo_source, "train.max_steps=80"), pool)
    deployer.variant("retrain-b", _small(root, demo_source, "train.max_steps=80", "train.seed=1"), pool)
    first, second = _run(deployed, "retrain-a", {}), _run(deployed, "retrain-b", {})
    worker = start_worker(pool)  # one process worker runs both flow runs at the same time
    for run_id in (first, second):
        _wait_final(deployed, run_id, 420, worker)
    a, b = sorted([_train_interval(deployed, first), _train_interval(deployed, second)])
    assert a[1] <= b[0], f"training overlapped: {a} and {b}"
    assert len(list((root / "runs").glob("*/report.json"))) == 2


def _flow_run_process(run_id: str) -> int | None:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        # The process the worker started: the `prefect flow-run execute` supervisor.
        if f"PREFECT__FLOW_RUN_ID={run_id}".encode() in environ and b"flow-run\0execute" in cmdline:
            return int(entry)
    return None


def _checkpoints(root: Path) -> list[Path]:
    return sorted(root.glob("runs/*/checkpoints/step-*[0-9]"))


def test_a_sigtermed_run_of_a_partial_override_is_rescheduled_and_resumes_from_its_checkpoint(
        deployed: PrefectServer, deployer: Deployer, start_worker: Callable[[str], Worker], tmp_path: Path,
        demo_source: Path) -> None:
    pool = _pool(deployed)
    root = tmp_path / "root"
    deployer.variant("retrain-spot", _small(root, demo_source, "train.eval_every=400", "train.checkpoint.every=40",
                                            "train.patience=0"), pool)
    # The README's example: a partial config naming train.max_steps alone. Prefect alone would
    # replace the whole config, and the run would fall back to ./.retrain and the demo data.
    # 2400 steps: the SIGTERM lands a poll after step 80's checkpoint, and the run must still be
    # training then (with 400 steps, a clean-clone CI run finished training first).
    out = deployed.cli("deployment", "run", "retrain/retrain-spot", "--param", 'config={"train": {"max_steps": 2400}}')
    run_id = next(line.split()[-1] for line in out.stdout.splitlines() if "UUID" in line)
    worker = start_worker(pool)
    wait_for(lambda: len(_checkpoints(root)) >= 2, 300, "two checkpoints", 0.2)
    pid = wait_for(lambda: _flow_run_process(run_id), 60, "the flow-run process")
    os.kill(pid, signal.SIGTERM)  # a spot reclaim / node drain
    # Rescheduled (not Crashed), picked up again by the worker, and completed.
    try:
        wait_for(lambda: flow_run(deployed, run_id)["run_count"] >= 2 or _state(deployed, run_id) == "SCHEDULED",
                 120, "the run to be rescheduled")
    except AssertionError:
        raise AssertionError(f"{flow_run(deployed, run_id)['state']}\n{worker.log_path.read_text()[-6000:]}") from None
    _wait_final(deployed, run_id, 420, worker)
    (report_path,) = root.glob("runs/*/report.json")
    report = json.loads(report_path.read_text())
    assert report["steps"] == 2400  # the override, kept by the rescheduled attempt too
    assert report["stages"]["pack"]["rows"]["train"] < 8000  # the deployment's small dataset, not the demo
    assert report["prefect_flow_run_id"] == run_id
    assert not list((tmp_path / "worker-0").rglob(".retrain"))
    # Named for what it trained: the deployment's source, which the override did not name.
    assert flow_run(deployed, run_id)["name"].startswith(f"{demo_source.stem}-"), flow_run(deployed, run_id)["name"]
    assert report["preemptions"] >= 1
    assert report["resumed_from_steps"] and report["resumed_from_steps"][0] >= 80  # not from step 0
    with deployed.api() as api:
        response = api.get("/flow_run_states/", params={"flow_run_id": run_id})
        names = [s["type"] for s in response.json()]
    assert "SCHEDULED" in names[1:] and "CRASHED" not in names, names
    # The project's own account of it, in the run's log (the UI).
    with deployed.api() as api:
        logs = api.post("/logs/filter", json={"logs": {"flow_run_id": {"any_": [run_id]}}, "limit": 200}).json()
    said = [log["message"] for log in logs if "emergency checkpoint written" in log["message"]]
    assert said and "the rescheduled flow run resumes from it" in said[0], [log["message"] for log in logs][-30:]
    # A preemption is not an error: the stopped train task is Preempted, not Crashed, and the
    # engine's "Crash detected!" line is a warning that says what happened.
    assert not [log for log in logs if log["level"] >= 40 and "Crash detected" in log["message"]]
    assert not [log for log in logs if log["level"] >= 40 and "Finished in state Crashed" in log["message"]]
    with deployed.api() as api:
        tasks = api.post("/task_runs/filter", json={"flow_runs": {"id": {"any_": [run_id]}}}).json()
    trains = sorted((t for t in tasks if t["task_key"].startswith("train")), key=lambda t: t["start_time"] or "")
    states = [(t["state"]["type"], t["state"]["name"]) for t in trains]
    assert states[0] == ("CANCELLED", "Preempted") and states[-1] == ("COMPLETED", "Completed"), states
    assert "emergency checkpoint written; the rescheduled flow run resumes from it" in trains[0]["state"]["message"]


def _delete_automations(server: PrefectServer, names: list[str]) -> None:
    with server.api() as api:
        for automation in api.post("/automations/filter", json={}).json():
            if automation["name"] in names:
                api.delete(f"/automations/{automation['id']}")


def test_a_sigkilled_process_run_is_rescheduled_by_the_shipped_automation_and_finishes_its_original_config(
        deployed: PrefectServer, deployer: Deployer, start_worker: Callable[[str], Worker], tmp_path: Path,
        demo_source: Path) -> None:
    """The whole process tree of a run on the shipped process deployment is SIGKILLed mid-
    training, and its deployment's config is edited meanwhile (a UI edit, a CI deploy). Nobody
    touches the run: the shipped automation reschedules it, and it resumes and finishes the
    config it began with, from its checkpoint."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "retrain_cli.main", "automations"], env=deployed.env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)  # not the repository root: the shipped ones
    assert out.returncode == 0 and "retrain-reschedule-crashed-runs" in out.stdout, out.stdout + out.stderr[-2000:]
    try:
        pool = _pool(deployed)
        root = tmp_path / "root"
        original = _small(root, demo_source, "train.max_steps=2400", "train.eval_every=400",
                          "train.checkpoint.every=40", "train.patience=0")
        deployer.variant("retrain-killed", original, pool)
        # A partial override, as from the UI: Prefect stores it in place of the whole config, and
        # the flow merges it over the deployment's at every start.
        run_id = _run(deployed, "retrain-killed", {"config": {"train": {"eval_every": 400}}})
        worker = start_worker(pool)
        wait_for(lambda: len(_checkpoints(root)) >= 2, 300, "two checkpoints", 0.2)
        edited = {**original, "train": {**original["train"], "max_steps": 600}}
        with deployed.api() as api:
            dep = deployment(deployed, "retrain-killed")
            api.patch(f"/deployments/{dep['id']}", json={"parameters": {"config": edited}}).raise_for_status()
        pid = wait_for(lambda: _flow_run_process(run_id), 60, "the flow-run process")
        for victim in [pid, *_descendants(pid)]:  # the run's whole tree, not its worker: no handler runs
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        wait_for(lambda: flow_run(deployed, run_id)["run_count"] >= 2, 300, "the automation to reschedule the run")
        _wait_final(deployed, run_id, 600, worker)
    finally:
        _delete_automations(deployed, ["retrain-reschedule-crashed-runs", "retrain-crash-silent-runs"])
    (report_path,) = root.glob("runs/*/report.json")
    report = json.loads(report_path.read_text())
    assert report["steps"] == 2400 and report["resumed_from_steps"] and report["resumed_from_steps"][0] >= 40
    with deployed.api() as api:
        states = [s["type"] for s in api.get("/flow_run_states/", params={"flow_run_id": run_id}).json()]
        logs = api.post("/logs/filter", json={"logs": {"flow_run_id": {"any_": [run_id]}, "level": {"ge_": 20}},
                                              "sort": "TIMESTAMP_ASC", "limit": 200}).json()
        tasks = api.post("/task_runs/filter", json={"flow_runs": {"id": {"any_": [run_id]}}}).json()
    assert "CRASHED" in states and states[-1] == "COMPLETED", states
    assert flow_run(deployed, run_id)["run_count"] == 2, states  # rescheduled once: one attempt after the kill
    assert any("changed since this flow run began" in log["message"] for log in logs)
    # The killed attempt's root slot was released by the next attempt, not waited out.
    assert any("released the storage root slot this flow run's last attempt held" in log["message"] for log in logs)
    assert not any("is in use by another run" in log["message"] for log in logs)
    trains = [t for t in tasks if t["task_key"].startswith("train")]
    assert "RUNNING" not in {t["state"]["type"] for t in trains}, [t["state"] for t in trains]


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc: Linux)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    below: list[int] = []
    frontier = {pid}
    while frontier:
        frontier = {child for child, ppid in parent.items() if ppid in frontier}
        below.extend(frontier)
    return below
