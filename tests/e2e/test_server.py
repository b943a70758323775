"""`retrain server`: a Prefect server on PostgreSQL in one command, with the shipped work pool and
its queues; stopped by a signal, with its database; started again on the same data, where a
storage root's slot that a run held across the restart is freed once its lease lapses."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import wait_for
from tests.postgres import postgres_bin
from retrain_cli.temp_server import free_port

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(postgres_bin() is None, reason="PostgreSQL is not installed (.ci/run installs it)")]


def _start(data: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    return subprocess.Popen([sys.executable, "-m", "retrain_cli.main", "server", "--data", str(data), "--port", str(port),
                             "--slots", "3"], stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def _stopped(proc: subprocess.Popen[bytes], data: Path) -> None:
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 0
    assert not (data / "postgres" / "postmaster.pid").exists()  # the database stopped with it


def test_retrain_server_runs_prefect_on_postgresql_with_the_pool_and_its_queues() -> None:
    # Under /tmp, not pytest's 0700 folder: started as root, the cluster runs as `postgres`.
    top = Path(tempfile.mkdtemp(prefix="retrain-server-test-"))
    top.chmod(0o755)
    try:
        _up_and_down(top / "server", top / "server.log")
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _said(proc: subprocess.Popen[bytes], log: Path, times: int) -> bool:
    assert proc.poll() is None, log.read_text()[-3000:]
    return log.read_text().count("Ctrl-C stops it") == times


def _up_and_down(data: Path, log: Path) -> None:
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    proc = _start(data, port, log)
    try:
        wait_for(lambda: _said(proc, log, 1), 300, "the server to say it is up")
        assert httpx.get(f"{api}/health", timeout=10).json() is True
        queues = {q["name"]: q for q in httpx.post(f"{api}/work_pools/retrain-process/queues/filter", json={},
                                                   timeout=10).json()}
        assert queues["light"]["priority"] < queues["training"]["priority"] and queues["training"]["concurrency_limit"] == 2
        pool = httpx.get(f"{api}/work_pools/retrain-process", timeout=10).json()
        assert pool["type"] == "process" and pool["concurrency_limit"] == 3
        assert "PostgreSQL" in log.read_text() and (data / "postgres" / "PG_VERSION").exists()
        assert oct((data / "database.json").stat().st_mode & 0o777) == "0o600"
        # A run holds a storage root's slot (as tasks/root_slot.py takes it) when the server stops.
        httpx.post(f"{api}/v2/concurrency_limits/", json={"name": ROOT_LIMIT, "limit": 1}, timeout=10)
        held = httpx.post(f"{api}/v2/concurrency_limits/increment-with-lease", timeout=10,
                          json={"names": [ROOT_LIMIT], "slots": 1, "mode": "concurrency", "lease_duration": 60})
        assert held.status_code == 200, held.text
        assert _slots(api) == 1
    finally:
        _stopped(proc, data)
    again = _start(data, port, log)  # the same data: the cluster and the pool are kept, not made twice
    try:
        wait_for(lambda: _said(again, log, 2), 300, "the server to come up again")
        assert httpx.get(f"{api}/work_pools/retrain-process", timeout=10).json()["concurrency_limit"] == 3
        # Nobody renews that lease now: the restarted server still knows it (its leases are on
        # disk, not in the memory of the server that stopped) and frees the slot when it lapses.
        wait_for(lambda: _slots(api) == 0, 240, "the dead run's root slot to be freed after the restart")
    finally:
        _stopped(again, data)


ROOT_LIMIT = "retrain-root-restart-check"


def _slots(api: str) -> int:
    return int(httpx.get(f"{api}/v2/concurrency_limits/{ROOT_LIMIT}", timeout=10).json()["active_slots"])
