"""A real `mlflow server` on 127.0.0.1 with a SQLite backend, started and stopped by a test."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MlflowServer:
    def __init__(self, home: Path) -> None:
        self.home = home
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120) -> MlflowServer:
        self.home.mkdir(parents=True, exist_ok=True)
        log = open(self.home / "server.log", "ab")
        # No job runner: it serves MLflow's GenAI jobs (scorers, trace rollups), which tracking
        # and the model registry, all this project uses, never start; it is a consumer of ten
        # workers beside the server.
        env = {**os.environ, "MLFLOW_ENABLE_TELEMETRY": "false", "DO_NOT_TRACK": "true",
               "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--backend-store-uri", f"sqlite:///{self.home / 'mlflow.db'}",
             "--artifacts-destination", str(self.home / "artifacts"), "--workers", "1"],
            cwd=self.home, stdout=log, stderr=log, env=env, start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited: {(self.home / 'server.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError("mlflow server did not come up")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)  # its uvicorn workers too
            self.proc.wait(30)
