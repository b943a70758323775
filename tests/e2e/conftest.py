"""A real `prefect server start` on 127.0.0.1 with a home of its own and a PostgreSQL database
(tests/postgres.py), stopped by PID; the deployments deployed as CI does it (from a clone that
is then deleted); workers run elsewhere."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest
import yaml

from tests.postgres import PostgresCluster, running_postgres

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrefectServer:
    def __init__(self, home: Path, port: int, database_url: str) -> None:
        self.port, self.home, self.database_url = port, home, database_url
        self.log_path = home / "server.log"
        self.api_url = f"http://127.0.0.1:{port}/api"
        self.ui_url = f"http://127.0.0.1:{port}"
        self.env = {
            **os.environ,
            "PREFECT_HOME": str(home),
            "PREFECT_API_URL": self.api_url,
            # Without this the UI calls port 4200 and shows "Can't connect".
            "PREFECT_UI_API_URL": self.api_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_DATABASE_CONNECTION_URL": database_url,
        }

    def cli(self, *args: str, timeout: float = 120, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
        out = subprocess.run([sys.executable, "-m", "prefect", *args], env=self.env, cwd=cwd, capture_output=True,
                             text=True, timeout=timeout)
        assert out.returncode == 0, f"prefect {' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        return out

    def api(self) -> httpx.Client:
        return httpx.Client(base_url=self.api_url, timeout=30, transport=_RetryingTransport())


class _RetryingTransport(httpx.HTTPTransport):
    """Retries 503 and 429, and a request that timed out when sending it again is safe, as
    Prefect's own client does: a server on a loaded machine can answer 503 or be slow to answer.
    A timed-out write other than an idempotent one may have landed, so it is not repeated (see
    `_repeatable`)."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        for attempt in range(7):
            try:
                response = super().handle_request(request)
            except httpx.ReadTimeout:
                if not _repeatable(request):
                    raise  # a write may have landed: not repeated blindly
                time.sleep(min(0.25 * 2**attempt, 5.0))
                continue
            if response.status_code not in (429, 503):
                return response
            response.read()
            response.close()
            try:
                wait = float(response.headers.get("Retry-After", ""))
            except ValueError:
                wait = 0.0
            time.sleep(min(max(wait, 0.25 * 2**attempt), 5.0))
        return super().handle_request(request)  # the eighth try, whatever it answers


def _repeatable(request: httpx.Request) -> bool:
    """Requests that may be sent again: GETs, PUTs, PATCHes and DELETEs (idempotent by HTTP's
    rules), and Prefect's query endpoints, which take their filter as a POST body."""
    return request.method in ("GET", "PUT", "PATCH", "DELETE") or (
        request.method == "POST" and request.url.path.rstrip("/").rsplit("/", 1)[-1] in ("filter", "count"))


@contextlib.contextmanager
def running_server(home: Path, postgres: PostgresCluster, database_url: str | None = None,
                   port: int | None = None) -> Iterator[PrefectServer]:
    """`prefect server start` with its own home and a new database of `postgres` (or
    `database_url`, on `port`: the same server started again), with the settings `retrain server`
    gives its server, until the block ends."""
    from retrain_cli.server import SERVER_SETTINGS

    server = PrefectServer(home, port or _free_port(), database_url or postgres.new_database())
    log = open(home / "server.log", "a")
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(server.port)],
        # The scheduler's loop every 5 s instead of 60: the scheduled-runs test waits for it,
        # and only its interval, not what it does, would make that test slower.
        env={**server.env, **postgres.SERVER_ENV, **SERVER_SETTINGS, "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5"},
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
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


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresCluster]:
    try:
        with running_postgres() as cluster:
            yield cluster
    except RuntimeError as err:
        pytest.fail(str(err))


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory, postgres: PostgresCluster) -> Iterator[PrefectServer]:
    with running_server(tmp_path_factory.mktemp("prefect-server-home"), postgres) as server:
        yield server


POOL = "retrain-process"
BRANCH = "main"


def snapshot_repository(dest: Path) -> Path:
    """A bare git repository holding this working tree as it is now (tracked files and untracked,
    not ignored ones): what CI would push. Deployments clone it through their pull step."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    src = dest / "snapshot"
    for rel in filter(None, listed):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    git = {**os.environ, "GIT_AUTHOR_NAME": "ci", "GIT_AUTHOR_EMAIL": "ci@localhost", "GIT_COMMITTER_NAME": "ci",
           "GIT_COMMITTER_EMAIL": "ci@localhost"}
    for args in (["init", "-q", "-b", BRANCH], ["add", "-A"], ["commit", "-q", "-m", "snapshot"]):
        subprocess.run(["git", *args], cwd=src, env=git, check=True)
    bare = dest / "retrain.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(src), str(bare)], check=True)
    shutil.rmtree(src)
    return bare


class Deployer:
    """`prefect deploy` as a hosted CI runner does it: from a fresh clone, deleted afterwards."""

    def __init__(self, server: PrefectServer, repository: Path, scratch: Path) -> None:
        self.server = server
        self.repository = repository
        self.scratch = scratch
        self.env = {"RETRAIN_GIT_REPOSITORY": repository.as_uri(), "RETRAIN_GIT_BRANCH": BRANCH}

    def deploy(self, spec: dict | None = None, name: str | None = None, files: dict[str, Path] | None = None,
               env: dict[str, str] | None = None, timeout: float = 240) -> None:
        """Deploy deployments/prefect.yaml (all of it), or `spec` (a prefect.yaml as a dict);
        `files` are copied into the checkout first (relative path -> source), `env` is added to
        the deploy's environment."""
        checkout = Path(tempfile.mkdtemp(prefix="ci-checkout-", dir=self.scratch))
        subprocess.run(["git", "clone", "-q", "--branch", BRANCH, self.repository.as_uri(), str(checkout)], check=True)
        for rel, source in (files or {}).items():
            shutil.copy(source, checkout / rel)
        prefect_file = "deployments/prefect.yaml"
        if spec is not None:
            prefect_file = f"deployments/{name}.yaml"
            (checkout / prefect_file).write_text(yaml.safe_dump(spec, sort_keys=False))
        env = {**self.server.env, **self.env, **(env or {})}
        out = subprocess.run([sys.executable, "-m", "prefect", "deploy", "--all", "--no-prompt", "--prefect-file",
                              prefect_file], env=env, cwd=checkout, capture_output=True, text=True, timeout=timeout)
        shutil.rmtree(checkout)  # as a hosted runner does: runs must not need it
        assert out.returncode == 0, f"prefect deploy failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"

    def variant(self, name: str, config: dict, pool: str, schedules: list | None = None) -> None:
        """One deployment like the repo's `retrain` (same pull step, env, entrypoint), under
        another name, pool and parameters."""
        spec = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
        base = next(d for d in spec["deployments"] if d["name"] == "retrain")
        dep = {**base, "name": name, "parameters": {"config": config}, "schedules": schedules or [],
               "work_pool": {**base["work_pool"], "name": pool}}
        spec.pop("definitions", None)  # anchors are already resolved by safe_load
        spec["deployments"] = [dep]
        self.deploy(spec, name)


    def predict_after(self, retrain_deployment: str, pool: str, config: dict, input: str, output: str) -> str:
        """The repo's `predict` deployment (its trigger as shipped) for runs of
        `retrain_deployment`, in `pool`; returns its name."""
        spec = yaml.safe_load((ROOT / "deployments" / "prefect.yaml").read_text())
        base = next(d for d in spec["deployments"] if d["name"] == "predict")
        (trigger,) = base["triggers"]
        trigger = {**trigger, "match_related": {**trigger["match_related"], "prefect.resource.name": retrain_deployment}}
        name = f"predict-after-{retrain_deployment}"
        dep = {**base, "name": name, "parameters": {"input": input, "output": output, "config": config},
               "triggers": [trigger], "work_pool": {**base["work_pool"], "name": pool}}
        spec.pop("definitions", None)
        spec["deployments"] = [dep]
        self.deploy(spec, name)
        return name


@pytest.fixture(scope="session")
def deployer(prefect_server: PrefectServer, tmp_path_factory: pytest.TempPathFactory) -> Deployer:
    scratch = tmp_path_factory.mktemp("ci")
    return Deployer(prefect_server, snapshot_repository(scratch), scratch)


@pytest.fixture(scope="session")
def deployed(prefect_server: PrefectServer, deployer: Deployer) -> PrefectServer:
    """The server with the work pool created and deployments/prefect.yaml deployed, as from CI."""
    prefect_server.cli("work-pool", "create", POOL, "--type", "process")
    deployer.deploy()
    return prefect_server


class Worker:
    """`prefect worker start` in a directory of its own, stopped by PID."""

    def __init__(self, server: PrefectServer, pool: str, cwd: Path, log: Path) -> None:
        self.server, self.pool, self.log_path = server, pool, log
        self._log = open(log, "w")
        env = {**server.env, "PREFECT_WORKER_QUERY_SECONDS": "2", "PREFECT_WORKER_PREFETCH_SECONDS": "5"}
        self.proc = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", pool],
                                     env=env, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def stop(self) -> None:
        """Stopped as an operator stops one: a first SIGTERM (it takes no new run), then the
        flow runs it started are SIGKILLed: each is a session of its own, out of reach of the
        worker's signal, and a stopping worker waits for them (a schedule's run in flight would
        hold it, then outlive it). Once the server holds none of the pool's runs as running (the
        worker reported them crashed), a second SIGTERM, which a Prefect worker takes as its kill:
        on a loaded machine a worker whose runs are gone was seen to linger for over 30 s."""
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        escalated = False
        while self.proc.poll() is None and time.monotonic() < deadline:
            runs = _process_groups_below(self.proc.pid)
            for group in runs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(group, signal.SIGKILL)
            if not runs and not escalated and not self._runs_in_flight():
                self._signal(signal.SIGTERM)
                escalated = True
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=0.5)
        if self.proc.poll() is None:
            self._signal(signal.SIGKILL)
            self.proc.wait()
        self._log.close()

    def _signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signum)

    def _runs_in_flight(self) -> bool:
        with self.server.api() as api:
            response = api.post("/flow_runs/filter", json={
                "work_pools": {"name": {"any_": [self.pool]}},
                "flow_runs": {"state": {"type": {"any_": ["PENDING", "RUNNING"]}}}, "limit": 1})
        return response.status_code != 200 or bool(response.json())


def _process_groups_below(pid: int) -> set[int]:
    """The process groups of `pid`'s descendants, other than its own (from /proc: Linux)."""
    parent: dict[int, int] = {}
    group: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone since the listing
            continue
        parent[int(entry.name)], group[int(entry.name)] = int(fields[1]), int(fields[2])
    below, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, ppid in parent.items() if ppid in frontier} - below
        below |= frontier
    return {group[p] for p in below} - {group.get(pid, pid), 0}


@pytest.fixture
def start_worker(prefect_server: PrefectServer, tmp_path: Path) -> Iterator[Callable[[str], Worker]]:
    workers: list[Worker] = []

    def start(pool: str) -> Worker:
        cwd = tmp_path / f"worker-{len(workers)}"  # not the repo: the code must come from the pull step
        cwd.mkdir()
        worker = Worker(prefect_server, pool, cwd, tmp_path / f"worker-{len(workers)}.log")
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        worker.stop()


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 1.0) -> Any:
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def flow_runs_of(server: PrefectServer, deployment_id: str) -> list[dict]:
    with server.api() as api:
        response = api.post("/flow_runs/filter", json={"flow_runs": {"deployment_id": {"any_": [deployment_id]}}})
        response.raise_for_status()
        return response.json()


def deployment(server: PrefectServer, name: str, flow: str = "retrain") -> dict:
    with server.api() as api:
        response = api.get(f"/deployments/name/{flow}/{name}")
        response.raise_for_status()
        return response.json()


def flow_run(server: PrefectServer, flow_run_id: str) -> dict:
    with server.api() as api:
        response = api.get(f"/flow_runs/{flow_run_id}")
        response.raise_for_status()
        return response.json()
