"""The empty database copy of the CLI's temporary Prefect server: copied whole through SQLite's
backup API, and used only when intact and migrated. (That a new root's server starts from it,
and that it holds no runs, is tested through the CLI: tests/e2e/test_cli.py.)"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from retrain_cli.temp_server import copy_database, is_migrated


def _database(path: Path, migrated: bool) -> Path:
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA journal_mode=WAL")  # as Prefect's server keeps its database
        db.execute("CREATE TABLE alembic_version (version_num TEXT)")
        if migrated:
            db.execute("INSERT INTO alembic_version VALUES ('abc123')")
        db.execute("CREATE TABLE flow_run (id TEXT)")
    db.close()
    return path


def test_the_copy_is_whole_and_stands_alone(tmp_path: Path) -> None:
    source = _database(tmp_path / "server.db", migrated=True)
    target = tmp_path / "home" / "empty.db"
    copy_database(source, target)
    assert is_migrated(target)
    assert not list(target.parent.glob("*.partial-*"))
    with sqlite3.connect(target) as db:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("delete",)  # no -wal beside it to go stale
    db.close()


def test_a_damaged_or_unmigrated_copy_is_not_used(tmp_path: Path) -> None:
    assert not is_migrated(_database(tmp_path / "new.db", migrated=False))
    damaged = tmp_path / "damaged.db"
    damaged.write_bytes(b"not a database")
    assert not is_migrated(damaged)
    assert not is_migrated(tmp_path / "missing.db")


def test_a_port_taken_between_choosing_and_binding_is_chosen_again(tmp_path: Path) -> None:
    """Another process binds the free port first (on a busy machine, another server starting):
    the temporary server binds a new one instead of failing the run."""
    import socket

    from retrain_cli.temp_server import TemporaryServer, server_is_up

    server = TemporaryServer(f"sqlite+aiosqlite:///{tmp_path / 'server.db'}", tmp_path / "server.log")
    taken = server.port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        try:
            server.start()
            assert server.port != taken and server_is_up(server.api_url)
            assert "address already in use" in (tmp_path / "server.log").read_text()
        finally:
            server.stop()
