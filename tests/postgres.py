"""A throwaway PostgreSQL cluster for the Prefect servers the end-to-end tests start.

A production Prefect server runs on PostgreSQL, and so do the tests' servers. On SQLite, under
the writes of a worker, its flow runs and the server's own services, the trigger service fails
with `database is locked` after an automation has fired; the event is then handled again and
the automation fires once per attempt (four reschedules of one crashed run, the last of which
revokes the concurrency lease of the container that had just resumed it).

One cluster per test process, on a free port, with its data in a temporary folder; each server
gets a database of its own, a copy (`createdb -T`) of one that Prefect's migrations and block
registration ran on once: a server started on it skips the registration, which imports every
installed integration (as the CLI's temporary server does on its database copy). Durability is
off (fsync, synchronous commit): it is thrown away.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import sys
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
    # Prefect's settings for a server on a database made from the template.
    SERVER_ENV = {"PREFECT_SERVER_REGISTER_BLOCKS_ON_START": "false",
                  "PREFECT_SERVER_MEMOIZE_BLOCK_AUTO_REGISTRATION": "false"}
    _TEMPLATE = "prefect_template"

    def __init__(self, bin_dir: Path, folder: Path, port: int, as_user: list[str]) -> None:
        self.bin_dir, self.folder, self.port, self._as_user = bin_dir, folder, port, as_user
        self._databases = 0
        self._template_ready = False

    def run(self, tool: str, *args: str) -> None:
        out = subprocess.run([*self._as_user, str(self.bin_dir / tool), *args], capture_output=True, text=True,
                             timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"{tool} {' '.join(args)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")

    def _url(self, name: str) -> str:
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/{name}"

    def new_database(self) -> str:
        """A new database with Prefect's tables and block types and nothing else; its SQLAlchemy
        URL for Prefect (start its server with SERVER_ENV)."""
        if not self._template_ready:
            self._make_template()
        self._databases += 1
        name = f"prefect_{self._databases}"
        self.run("createdb", "-h", str(self.folder), "-p", str(self.port), "-U", "postgres", "-T", self._TEMPLATE, name)
        return self._url(name)

    def _make_template(self) -> None:
        """Prefect's migrations and block registration, as its server runs them on start-up, on
        the template database; nothing stays connected to it (`createdb -T` needs that)."""
        self.run("createdb", "-h", str(self.folder), "-p", str(self.port), "-U", "postgres", self._TEMPLATE)
        home = tempfile.mkdtemp(prefix="retrain-test-prefect-template-")
        try:
            out = subprocess.run([sys.executable, "-c", _REGISTER], capture_output=True, text=True, timeout=300, env={
                **os.environ, "PREFECT_HOME": home, "PREFECT_SERVER_DATABASE_CONNECTION_URL": self._url(self._TEMPLATE),
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
        finally:
            shutil.rmtree(home, ignore_errors=True)
        if out.returncode != 0:
            raise RuntimeError(f"preparing Prefect's template database failed:\n{out.stderr[-3000:]}")
        self._template_ready = True


# What a Prefect server's start-up does to its database (prefect.server.api.server's lifespan).
_REGISTER = """
import asyncio

import prefect.plugins
from prefect.server.database import provide_database_interface
from prefect.server.models.block_registration import run_block_auto_registration


async def main():
    prefect.plugins.load_prefect_collections()  # the integrations' block types, as the server's start-up loads them
    db = provide_database_interface()
    await db.create_db()
    session = await db.session()
    async with session:
        await run_block_auto_registration(session=session)
        await session.commit()
    await (await db.engine()).dispose()  # the process exits with no connection left open


asyncio.run(main())
"""


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
