"""The CLI's temporary Prefect server: a new storage root starts from a migrated, empty copy of
the first temporary server's database instead of running Prefect's migrations again."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from retrain_cli import temp_server
from retrain_cli.temp_server import TemporaryServer

pytestmark = pytest.mark.slow


def _tables(path: Path) -> set[str]:
    with sqlite3.connect(path) as db:
        names = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    db.close()
    return names


def _count(path: Path, table: str) -> int:
    with sqlite3.connect(path) as db:
        (n,) = db.execute(f"SELECT count(*) FROM {table}").fetchone()
    db.close()
    return int(n)


def test_a_new_root_starts_from_the_empty_migrated_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "home" / "empty.db"
    monkeypatch.setattr(temp_server, "_empty_database_copy", lambda: empty)
    first = TemporaryServer(f"sqlite+aiosqlite:///{tmp_path / 'a' / 'server.db'}", tmp_path / "a" / "server.log")
    first.start()
    try:
        assert empty.exists() and "alembic_version" in _tables(empty) and "flow_run" in _tables(empty)
        assert _count(empty, "flow_run") == 0
    finally:
        first.stop()
    # Marked, so the next database shows where it came from.
    with sqlite3.connect(empty) as db:
        db.execute("CREATE TABLE copied_from_the_empty_database (x INTEGER)")
    db.close()
    second_db = tmp_path / "b" / "server.db"
    second = TemporaryServer(f"sqlite+aiosqlite:///{second_db}", tmp_path / "b" / "server.log")
    second.start()
    second.stop()
    assert "copied_from_the_empty_database" in _tables(second_db)
    # A damaged copy is not used: the server would migrate from scratch and keep a new copy.
    assert temp_server._is_migrated(empty)
    empty.write_bytes(b"not a database")
    assert not temp_server._is_migrated(empty)
