"""`retrain server`: a production Prefect server in one command, on PostgreSQL.

Prefect's own advice for production is PostgreSQL: on SQLite, a worker, its flow runs and the
server's services writing at once meet `database is locked`, and an automation can fire again for
each retried event. This command keeps a PostgreSQL cluster (Debian's `postgresql` package: its
`initdb` and `pg_ctl`) in a folder of its own, with a generated password, starts it on a free
loopback port, and runs `prefect server start` on it in the foreground; Ctrl-C or SIGTERM stops
both. Once the API answers, it makes the work pool the shipped deployments use (when `--pool`
names one), with a concurrency limit and two queues: `light` (predict, plan, watch: short, and
served first) and `training` (retrain, tune), whose own limit leaves one slot to the light flows,
so a scoring run never waits behind hours of training.
"""

from __future__ import annotations

import glob
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Callable

from training.errors import ConfigError

__all__ = ["LIGHT_QUEUE", "SERVER_SETTINGS", "TRAINING_QUEUE", "serve"]

TRAINING_QUEUE, LIGHT_QUEUE = "training", "light"
_USER, _DATABASE = "prefect", "prefect"


def _postgres_bin() -> Path:
    """Debian's newest versioned PostgreSQL folder, else the one pg_ctl on PATH is in."""
    folders = sorted((Path(p) for p in glob.glob("/usr/lib/postgresql/*/bin")),
                     key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)
    found = shutil.which("pg_ctl")
    for folder in [*reversed(folders), *([Path(found).resolve().parent] if found else [])]:
        if all((folder / tool).exists() for tool in ("initdb", "pg_ctl", "createdb", "psql")):
            return folder
    raise ConfigError("retrain server keeps Prefect's database in PostgreSQL, which is not installed here: "
                      "apt-get install postgresql (or your system's package)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Cluster:
    """The PostgreSQL cluster under `folder`: made once, started and stopped by this command."""

    def __init__(self, folder: Path) -> None:
        self.bin = _postgres_bin()
        self.folder, self.data, self.secret = folder, folder / "postgres", folder / "database.json"
        # initdb and postgres refuse to run as root: root runs them as Debian's `postgres` user.
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        self.port = _free_port()

    def _run(self, tool: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        out = subprocess.run([*self.as_user, str(self.bin / tool), *args], capture_output=True, text=True,
                             timeout=300, env={**os.environ, **(env or {})})
        if out.returncode != 0:
            raise ConfigError(f"retrain server: {tool} failed: {(out.stderr or out.stdout).strip().splitlines()[-1]}")
        return out

    def password(self) -> str:
        return str(json.loads(self.secret.read_text())["password"])

    def create(self) -> None:
        """initdb with password authentication; the password in a file only its owner reads."""
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.as_user and subprocess.run([*self.as_user, "test", "-x", str(self.folder)]).returncode != 0:
            raise ConfigError(f"retrain server runs PostgreSQL as the `postgres` user when started as root, and that "
                              f"user cannot reach {self.folder}: pass --data a folder it can (e.g. /var/lib/retrain), "
                              "or start retrain server as a regular user")
        if (self.data / "PG_VERSION").exists():
            return
        password = secrets.token_urlsafe(24)
        fd, pwfile = tempfile.mkstemp(prefix="retrain-pw-")
        try:
            os.write(fd, password.encode())
            os.close(fd)
            if self.as_user:
                shutil.chown(pwfile, user="postgres")
                self.data.mkdir(mode=0o700, exist_ok=True)
                shutil.chown(self.data, user="postgres")
            self._run("initdb", "-D", str(self.data), "-U", _USER, "-A", "scram-sha-256", "--pwfile", pwfile,
                      "-E", "UTF8")
        finally:
            os.unlink(pwfile)
        self.secret.write_text(json.dumps({"user": _USER, "password": password}))
        self.secret.chmod(0o600)

    def start(self) -> None:
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories='' -c max_connections=200"
        log = self.folder / "postgres.log"
        if self.as_user:
            log.touch()
            shutil.chown(log, user="postgres")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(log), "-o", options, "-w", "start")
        env = {"PGPASSWORD": self.password()}
        listed = self._run("psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", _USER, "-d", "postgres", "-tAc",
                           f"SELECT 1 FROM pg_database WHERE datname = '{_DATABASE}'", env=env)
        if listed.stdout.strip() != "1":
            self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", _USER, _DATABASE, env=env)

    def stop(self) -> None:
        subprocess.run([*self.as_user, str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop"],
                       capture_output=True, timeout=120)

    def url(self) -> str:
        return f"postgresql+asyncpg://{_USER}:{self.password()}@127.0.0.1:{self.port}/{_DATABASE}"


def _wait_for_api(api: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ConfigError(f"retrain server: the Prefect server exited ({proc.returncode}) before answering")
        try:
            with urllib.request.urlopen(f"{api}/health", timeout=2) as response:  # noqa: S310 - our own server
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise ConfigError(f"retrain server: the Prefect server did not answer at {api} within {timeout:.0f} s")


def make_work_pool(api: str, pool: str, slots: int) -> None:
    """The process pool with its concurrency limit and the two queues (idempotent)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectAlreadyExists
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=pool, type="process", concurrency_limit=slots))
        except ObjectAlreadyExists:
            client.update_work_pool(pool, WorkPoolUpdate(concurrency_limit=slots))
        queues = {TRAINING_QUEUE: (2, max(1, slots - 1)), LIGHT_QUEUE: (1, None)}
        existing = {q.name: q for q in client.read_work_queues(work_pool_name=pool)}
        for name, (priority, limit) in queues.items():
            if name in existing:
                client.update_work_queue(existing[name].id, priority=priority, concurrency_limit=limit)
            else:
                client.create_work_queue(name=name, work_pool_name=pool, priority=priority, concurrency_limit=limit)


# What the pipeline needs of a Prefect server beyond its defaults. Concurrency leases (a storage
# root's slot is one) live in the server's memory by default, so a restart forgets the lease of a
# run that was holding the slot and the limit stays taken for good; on disk beside the server's
# data, a restarted server finds each lease and frees it when it lapses.
SERVER_SETTINGS = {"PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect.server.concurrency.lease_storage.filesystem"}


def serve(folder: Path, host: str, port: int, pool: str | None, slots: int, say: Callable[[str], None]) -> int:
    """Run the server until Ctrl-C or SIGTERM; its exit status."""
    cluster = _Cluster(folder)
    cluster.create()
    cluster.start()
    api = f"http://{host}:{port}/api"
    env = {**os.environ, "PREFECT_SERVER_DATABASE_CONNECTION_URL": cluster.url(), "PREFECT_UI_API_URL": api,
           "PREFECT_UI_URL": f"http://{host}:{port}", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           # The leases under the data folder, with the database: they survive a restart.
           "PREFECT_HOME": str(folder / "prefect-home"), **SERVER_SETTINGS}
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(port)],
                            env=env, start_new_session=True)
    stopping: list[int] = []

    def stop(signum: int, frame: object) -> None:
        stopping.append(signum)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        _wait_for_api(api, proc)
        if pool is not None:
            make_work_pool(api, pool, slots)
            say(f"work pool {pool}: {slots} flow runs at once; queues {LIGHT_QUEUE} (served first) and "
                f"{TRAINING_QUEUE} (at most {max(1, slots - 1)})")
        say(f"Prefect server on PostgreSQL ({cluster.data}) at {api}; on the workers and for `prefect deploy`: "
            f"export PREFECT_API_URL={api}. Ctrl-C stops it")
        code = proc.wait()
        return 0 if stopping else code
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)
        cluster.stop()
