"""A throwaway PostgreSQL cluster for the Prefect servers the end-to-end tests start.

A production Prefect server runs on PostgreSQL, and so do the tests' servers. On SQLite, under
the writes of a worker, its flow runs and the server's own services, the trigger service fails
with `database is locked` after an automation has fired; the event is then handled again and
the automation fires once per attempt (four reschedules of one crashed run, the last of which
revokes the concurrency lease of the container that had just resumed it).

One cluster per test process, on a free port, with its data in a temporary folder; each server
gets a database of its own. Durability is off (fsync, synchronous commit): it is thrown away.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

__all__ = ["PostgresCluster", "postgres_bin", "running_postgres"]

MISSING = ("the end-to-end tests run their Prefect server on PostgreSQL, as a production server does: "
           "install it (apt-get install postgresql); .ci/run does")


def postgres_bin() -> Path | None:
    """The folder holding initdb, pg_ctl and createdb: Debian's versioned folder (the newest),
    else the one pg_ctl resolves to on PATH."""
    folders = sorted((Path(p) for p in glob.glob("/usr/lib/postgresql/*/bin")),
                     key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)
    found = shutil.which("pg_ctl")
    for folder in [*reversed(folders), *([Path(found).resolve().parent] if found else [])]:
        if all((folder / tool).exists() for tool in ("initdb", "pg_ctl", "createdb")):
            return folder
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PostgresCluster:
    def __init__(self, bin_dir: Path, folder: Path, port: int, as_user: list[str]) -> None:
        self.bin_dir, self.folder, self.port, self._as_user = bin_dir, folder, port, as_user
        self._databases = 0

    def run(self, tool: str, *args: str) -> None:
        out = subprocess.run([*self._as_user, str(self.bin_dir / tool), *args], capture_output=True, text=True,
                             timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"{tool} {' '.join(args)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")

    def new_database(self) -> str:
        """A new, empty database; its SQLAlchemy URL for Prefect."""
        self._databases += 1
        name = f"prefect_{self._databases}"
        self.run("createdb", "-h", str(self.folder), "-p", str(self.port), "-U", "postgres", name)
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/{name}"


@contextlib.contextmanager
def running_postgres() -> Iterator[PostgresCluster]:
    bin_dir = postgres_bin()
    if bin_dir is None:
        raise RuntimeError(MISSING)
    # initdb refuses to run as root: root runs the cluster as Debian's `postgres` user.
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    folder = Path(tempfile.mkdtemp(prefix="retrain-test-pg-"))
    if as_user:
        shutil.chown(folder, user="postgres")
    cluster = PostgresCluster(bin_dir, folder, _free_port(), as_user)
    data = folder / "data"
    try:
        cluster.run("initdb", "-D", str(data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync")
        options = (f"-p {cluster.port} -k {folder} -c listen_addresses=127.0.0.1 -c max_connections=200 "
                   "-c fsync=off -c synchronous_commit=off -c full_page_writes=off")
        cluster.run("pg_ctl", "-D", str(data), "-l", str(folder / "postgres.log"), "-o", options, "-w", "start")
        yield cluster
    finally:
        if (data / "postmaster.pid").exists():
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                cluster.run("pg_ctl", "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(folder, ignore_errors=True)
