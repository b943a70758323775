"""The empty database copy of the CLI's temporary Prefect server: copied whole through SQLite's
backup API, used only when intact and migrated, and holding every block type of the installed
integrations. (That a new root's server starts from it, and that it holds no runs, is tested
through the CLI: tests/e2e/test_cli.py.)"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

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


def test_a_server_started_from_the_copy_has_every_block_type_of_the_integrations(tmp_path: Path) -> None:
    """A server on a database made from the copy skips Prefect's block registration, then and
    when the root's next run starts one again: the copy, made per Prefect version and set of
    integrations, must hold every block type they define."""
    import json
    import urllib.request

    from retrain_cli.temp_server import TemporaryServer, has_every_block_type, registration_skipped

    servers = []
    for name in ("first", "second"):  # the first keeps a copy when there is none yet
        server = TemporaryServer(f"sqlite+aiosqlite:///{tmp_path / name / 'server.db'}", tmp_path / name / "log")
        server.start()
        servers.append(server)
        if server.seeded_from is not None:
            break
    try:
        assert server.seeded_from is not None and has_every_block_type(tmp_path / name / "server.db")
        # `retrain ui` starts its server on that database with the same settings.
        assert registration_skipped(tmp_path / name / "server.db")["PREFECT_SERVER_REGISTER_BLOCKS_ON_START"] == "false"
        assert registration_skipped(tmp_path / "none.db") == {}
        request = urllib.request.Request(f"{server.api_url}/block_types/filter", data=b"{}",  # noqa: S310 - loopback
                                         method="POST", headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request) as response:  # noqa: S310 - loopback
            on_server = {block_type["slug"] for block_type in json.loads(response.read())}
    finally:
        for server in servers:
            server.stop()
    defined = _defined_block_types()
    assert "aws-credentials" in defined  # prefect-aws's, which S3 runs use
    assert defined <= on_server, sorted(defined - on_server)


def test_the_test_servers_database_copy_has_every_block_type_of_the_integrations(prefect_server) -> None:
    """The tests' own servers start on a copy of a database registered once (tests/postgres.py),
    without registering: it must hold what a server's own registration would."""
    with prefect_server.api() as api:
        on_server = {block_type["slug"] for block_type in api.post("/block_types/filter", json={"limit": 200}).json()}
    assert _defined_block_types() <= on_server, sorted(_defined_block_types() - on_server)


def _defined_block_types() -> set[str]:
    """The block types of Prefect and the installed integrations, as a server's start-up finds them."""
    import prefect.plugins
    from prefect.blocks.core import Block
    from prefect.utilities.dispatch import get_registry_for_type

    prefect.plugins.load_prefect_collections()
    return set(get_registry_for_type(Block) or {})


def test_another_integration_version_gets_a_copy_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    from retrain_cli import temp_server

    before = temp_server.empty_database_copy()
    real = importlib.metadata.entry_points

    class Upgraded:
        name, version = "prefect-aws", "999.0"

    class EntryPoint:
        dist = Upgraded

    def entry_points(**kwargs: str) -> object:
        found = real(**kwargs)
        return [*found, EntryPoint()] if kwargs.get("group") == "prefect.collections" else found

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    after = temp_server.empty_database_copy()
    assert after != before and after.parent == before.parent
