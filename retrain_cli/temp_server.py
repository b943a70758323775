"""The temporary Prefect server of a `retrain run` that has no server to use.

It is Prefect's own temporary server (the same app, command and settings as its
`SubprocessASGIServer`), started in a session of its own: Prefect starts it in the CLI's
process group, so a Ctrl-C in the terminal killed the server at once, before the flow could
record that it was interrupted, and the CLI then hung for minutes on "All connection attempts
failed". Here the CLI stops it itself, after the flow has finished or recorded its interruption.

A new SQLite database costs about 9 s of Prefect's migrations on first start (15 s against 6 s
here). The first temporary server on a machine keeps a copy of its database as it is once up,
migrated, with the block types registered and no runs in it, under PREFECT_HOME and per Prefect
version and set of installed Prefect integrations; a later storage root starts from that copy.
A server on a database made from such a copy (marked in SQLite's `user_version`, which Prefect
leaves alone) skips the block registration, which imports every integration (prefect-aws,
prefect-kubernetes, prefect-dask...) to find its block types: about a third of its start-up.
"""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Literal

from training.errors import RetrainError

__all__ = ["TemporaryServer", "copy_database", "empty_database_copy", "free_port", "has_every_block_type",
           "is_migrated", "port_is_free", "seed_database", "server_is_up"]


def server_is_up(api_url: str, timeout: float = 0.5) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=timeout) as response:  # noqa: S310 - loopback only
            return bool(response.status == 200)
    except OSError:
        return False


def server_answers(api_url: str, timeout: float = 5.0) -> Literal["yes", "slow", "no"]:
    """Whether anything answers HTTP at `api_url` (a refusal such as 401 counts: a Prefect Cloud
    workspace wants its key, which the client sends and this probe does not); "slow" when it
    took the connection but did not answer within `timeout` (a busy server, not a missing one)."""
    import urllib.error

    try:
        with urllib.request.urlopen(f"{api_url.rstrip('/')}/health", timeout=timeout):  # noqa: S310 - the user's URL
            return "yes"
    except urllib.error.HTTPError:
        return "yes"
    except urllib.error.URLError as err:
        return "slow" if isinstance(err.reason, TimeoutError) else "no"
    except TimeoutError:  # connected, then no answer in time
        return "slow"
    except (OSError, ValueError):  # refused, unreachable, or not a URL at all
        return "no"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _sqlite_file(database_url: str) -> Path | None:
    prefix = "sqlite+aiosqlite:///"
    return Path(database_url[len(prefix):]) if database_url.startswith(prefix) else None


def empty_database_copy() -> Path:
    """Where the migrated, empty database of this Prefect version and these integrations is
    kept: another version of either may add block types, and gets a copy of its own."""
    from prefect.settings import get_current_settings

    return Path(get_current_settings().home) / f"retrain-empty-server-{_blocks_fingerprint()}.db"


def _blocks_fingerprint() -> str:
    """Prefect's version and the installed integrations (the `prefect.collections` entry points
    the server loads block types from), with their versions."""
    import hashlib
    import json
    from importlib.metadata import entry_points

    import prefect

    integrations = sorted({(ep.dist.name, ep.dist.version) for ep in entry_points(group="prefect.collections")
                           if ep.dist is not None})
    digest = hashlib.sha256(json.dumps(integrations).encode()).hexdigest()[:12]
    return f"{prefect.__version__}-{digest}"


def _registered_mark() -> int:
    """The `user_version` of a database whose block types are this Prefect's and these
    integrations' (a positive 28-bit number from the fingerprint)."""
    import hashlib

    return int(hashlib.sha256(_blocks_fingerprint().encode()).hexdigest()[:7], 16)


def has_every_block_type(path: Path) -> bool:
    """A database made from the empty copy of this Prefect and these integrations."""
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            (version,) = db.execute("PRAGMA user_version").fetchone()
        db.close()
    except sqlite3.Error:
        return False
    return bool(version == _registered_mark())


def registration_skipped(database: Path | None) -> dict[str, str]:
    """The settings under which a Prefect server skips its block registration at start-up: for a
    database that already has every block type (made from the empty copy); none otherwise."""
    if database is None or not has_every_block_type(database):
        return {}
    return {"PREFECT_SERVER_REGISTER_BLOCKS_ON_START": "false",
            # Memoizing would import every integration to hash its blocks: the cost being skipped.
            "PREFECT_SERVER_MEMOIZE_BLOCK_AUTO_REGISTRATION": "false"}


def copy_database(source: Path, target: Path, user_version: int | None = None) -> None:
    """A consistent copy through SQLite's backup API (the source may be open in WAL mode),
    written beside the target and renamed into place: a reader never sees half of it;
    `user_version` is set in the copy's header when given."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    try:
        with sqlite3.connect(f"file:{source}?mode=ro", uri=True) as src, sqlite3.connect(partial) as dst:
            src.backup(dst)
            dst.execute("PRAGMA journal_mode=DELETE")  # one file: no -wal beside it to go stale
            if user_version is not None:
                dst.execute(f"PRAGMA user_version={int(user_version)}")
        src.close()
        dst.close()
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def is_migrated(path: Path) -> bool:
    """An intact database that Prefect's migrations have run on."""
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            intact = db.execute("PRAGMA quick_check").fetchone() == ("ok",)
            migrated = intact and db.execute("SELECT count(*) FROM alembic_version").fetchone()[0] == 1
        db.close()
        return bool(migrated)
    except sqlite3.Error:
        return False


def seed_database(target: Path) -> Path | None:
    """Put the empty database copy at `target` when there is an intact, migrated one: a server
    started on it skips Prefect's migrations. The copy used, or None."""
    empty = empty_database_copy()
    if not is_migrated(empty):
        return None
    copy_database(empty, target)
    return empty


PORT_ATTEMPTS = 5


class _PortTaken(Exception):
    """uvicorn could not bind the chosen port: another process took it first."""


class TemporaryServer:
    """Prefect's temporary API server on 127.0.0.1, with its database at `database_url`."""

    def __init__(self, database_url: str, log_path: Path) -> None:
        self.database_url = database_url
        self.log_path = log_path
        self.port = free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self._proc: subprocess.Popen[bytes] | None = None
        self._exit_code: int | None = None
        self.seeded_from: Path | None = None  # the empty database copy this one started as

    def start(self, timeout: float = 120.0) -> None:
        database = _sqlite_file(self.database_url)
        fresh = database is not None and not database.exists()
        if fresh and database is not None:
            self.seeded_from = seed_database(database)
        # The port was free when chosen; another process may bind it before uvicorn does.
        for attempt in range(PORT_ATTEMPTS):
            try:
                self._launch(timeout)
                break
            except _PortTaken:
                if attempt == PORT_ATTEMPTS - 1:
                    raise RetrainError(f"the temporary Prefect server did not start: {PORT_ATTEMPTS} free ports were "
                                       f"taken before it could bind them (log {self.log_path})") from None
                self.port = free_port()
                self.api_url = f"http://127.0.0.1:{self.port}/api"
        if fresh and database is not None and self.seeded_from is None:
            try:  # the first on this machine: keep its database, migrated, registered and without runs
                copy_database(database, empty_database_copy(), user_version=_registered_mark())
            except (OSError, sqlite3.Error):
                pass  # only a later run's start-up is slower

    def _launch(self, timeout: float) -> None:
        import prefect

        env = {
            **os.environ,
            "PREFECT_UI_ENABLED": "0",
            "PREFECT__SERVER_EPHEMERAL": "1",  # as Prefect's own temporary server: no background services
            "PREFECT__SERVER_FINAL": "1",
            "PREFECT_SERVER_DATABASE_CONNECTION_URL": self.database_url,
        }
        env.update(registration_skipped(_sqlite_file(self.database_url)))
        env.pop("PREFECT_API_URL", None)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        from training.launch.process import with_parent_death_signal

        start = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                # Dies with the CLI even when the CLI is SIGKILLed: never an orphan server.
                with_parent_death_signal([
                    sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
                    "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(self.port),
                    "--log-level", "error", "--lifespan", "on"]),
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,  # a terminal Ctrl-C reaches the CLI, not the server
            )
        deadline = time.monotonic() + timeout
        while not server_is_up(self.api_url):
            self._exit_code = self._proc.poll()
            if self._exit_code is not None or time.monotonic() > deadline:
                with open(self.log_path, "rb") as log:
                    log.seek(start)
                    written = log.read().decode(errors="replace")  # by this launch
                self.stop()
                if "address already in use" in written:
                    raise _PortTaken()
                raise RetrainError(f"the temporary Prefect server did not start (log {self.log_path}): "
                                   f"{_start_failure(written, self._exit_code, timeout)}")
            time.sleep(0.2)

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _start_failure(written: str, exit_code: int | None, timeout: float) -> str:
    """Why the server did not start, in one line: the last line its log got, or, where it wrote
    nothing (a machine too busy to import Prefect in time), what happened and what to do."""
    lines = [line.strip() for line in written.splitlines() if line.strip()]
    if lines:
        return lines[-1][:500]
    if exit_code is not None:
        return (f"it exited with code {exit_code} before writing anything; run the same command again, or start one "
                "with `prefect server start` in another terminal")
    return (f"it did not answer within {timeout:.0f} s and wrote nothing (the machine is busy, or Prefect's first "
            "import after an install is slow); run the same command again, or start one with `prefect server start` "
            "in another terminal and keep it running")
