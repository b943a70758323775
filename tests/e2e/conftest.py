"""A real `prefect server start` on 127.0.0.1 with its own SQLite home, stopped by PID."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrefectServer:
    def __init__(self, home: Path, port: int) -> None:
        self.port = port
        self.api_url = f"http://127.0.0.1:{port}/api"
        self.ui_url = f"http://127.0.0.1:{port}"
        self.env = {
            **os.environ,
            "PREFECT_HOME": str(home),
            "PREFECT_API_URL": self.api_url,
            # Without this the UI calls port 4200 and shows "Can't connect".
            "PREFECT_UI_API_URL": self.api_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home / 'prefect.db'}",
        }

    def cli(self, *args: str, timeout: float = 120, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
        out = subprocess.run([sys.executable, "-m", "prefect", *args], env=self.env, cwd=cwd, capture_output=True,
                             text=True, timeout=timeout)
        assert out.returncode == 0, f"prefect {' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        return out

    def api(self) -> httpx.Client:
        return httpx.Client(base_url=self.api_url, timeout=30)


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    home = tmp_path_factory.mktemp("prefect-server-home")
    server = PrefectServer(home, _free_port())
    log = open(home / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(server.port)],
        env=server.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(f"{server.api_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"prefect server did not start:\n{(home / 'server.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield server
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


POOL = "retrain-process"


@pytest.fixture(scope="session")
def deployed(prefect_server: PrefectServer) -> PrefectServer:
    """The server with the work pool created and deployments/prefect.yaml deployed, as from CI."""
    prefect_server.cli("work-pool", "create", POOL, "--type", "process")
    prefect_server.cli("deploy", "--all", "--no-prompt", "--prefect-file", "deployments/prefect.yaml", timeout=180)
    return prefect_server


def deployment(server: PrefectServer, name: str) -> dict:
    with server.api() as api:
        response = api.get(f"/deployments/name/retrain/{name}")
        response.raise_for_status()
        return response.json()


def flow_run(server: PrefectServer, flow_run_id: str) -> dict:
    with server.api() as api:
        response = api.get(f"/flow_runs/{flow_run_id}")
        response.raise_for_status()
        return response.json()
