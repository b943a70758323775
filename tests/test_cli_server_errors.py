"""What the CLI says when the Prefect server is slow, failing or never starts: one line each,
with what to do, never a traceback."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from retrain_cli.main import _server_failure
from retrain_cli.temp_server import TemporaryServer, _start_failure, server_answers


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A server on 127.0.0.1 that takes connections and never answers: a busy Prefect server."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}/api"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    listener.close()


def test_a_busy_server_is_slow_not_missing(silent_server: str) -> None:
    assert server_answers(silent_server, timeout=0.5) == "slow"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    assert server_answers(f"http://127.0.0.1:{free}/api", timeout=0.5) == "no"


def test_a_server_that_fails_the_run_is_one_line(tmp_path: Path) -> None:
    request = httpx.Request("POST", "http://127.0.0.1:4200/api/flow_runs/")
    status = httpx.HTTPStatusError("500", request=request, response=httpx.Response(500, request=request))
    line = _server_failure(status, "http://127.0.0.1:4200/api", None)
    assert "answered HTTP 500 to POST /api/flow_runs/" in line and "\n" not in line

    slow = _server_failure(httpx.ReadTimeout("timed out", request=request), "http://127.0.0.1:4200/api", None)
    assert "did not answer in time (ReadTimeout)" in slow and "\n" not in slow

    server = TemporaryServer("sqlite+aiosqlite:///x.db", tmp_path / "server.log")
    server.log_path.write_text("INFO started\nsqlite3.OperationalError: database or disk is full\n")
    full = _server_failure(status, server.api_url, server)
    assert "ends: sqlite3.OperationalError: database or disk is full" in full and "check that disk has room" in full


def test_a_server_that_never_started_says_why_even_when_its_log_is_empty() -> None:
    assert _start_failure("", None, 120.0).startswith("it did not answer within 120 s and wrote nothing")
    assert "exited with code 3" in _start_failure("\n\n", 3, 120.0)
    assert _start_failure("Traceback ...\n  File x\nValueError: bad port\n", 1, 120.0) == "ValueError: bad port"
