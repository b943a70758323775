from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def prefect_harness() -> Iterator[None]:
    """One Prefect test server for every flow test (it takes 15-22 s to start here, most of it
    migrating a new database)."""
    import prefect.testing.utilities as harness
    from prefect.testing.utilities import prefect_test_harness

    from retrain_cli.temp_server import seed_database

    # The harness puts its database in a fresh mkdtemp() folder. When an earlier test's
    # temporary server kept the CLI's empty database copy, the folder gets that copy first and
    # the harness's server skips the migrations (about 9 s here); otherwise it migrates as usual.
    def seeded_temp_dir() -> str:
        folder = tempfile.mkdtemp()
        seed_database(Path(folder) / "prefect-test.db")
        return folder

    original = harness.mkdtemp
    harness.mkdtemp = seeded_temp_dir  # type: ignore[attr-defined]
    try:
        with prefect_test_harness(server_startup_timeout=180):
            harness.mkdtemp = original  # type: ignore[attr-defined]
            yield
    finally:
        harness.mkdtemp = original  # type: ignore[attr-defined]
