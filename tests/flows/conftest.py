from __future__ import annotations

import os
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

    from retrain_cli.temp_server import has_every_block_type, seed_database
    from tests.postgres import PostgresCluster

    # The harness puts its database in a fresh mkdtemp() folder. When an earlier test's
    # temporary server kept the CLI's empty database copy, the folder gets that copy first and
    # the harness's server skips the migrations (about 9 s here) and, as the CLI's would, the
    # block registration; otherwise it migrates and registers as usual.
    skip = PostgresCluster.SERVER_ENV  # the same Prefect settings as the end-to-end tests' servers

    def seeded_temp_dir() -> str:
        folder = tempfile.mkdtemp()
        seed_database(Path(folder) / "prefect-test.db")
        if has_every_block_type(Path(folder) / "prefect-test.db"):
            os.environ.update(skip)  # read by the harness's server process only
        return folder

    original = harness.mkdtemp
    harness.mkdtemp = seeded_temp_dir  # type: ignore[attr-defined]
    try:
        with prefect_test_harness(server_startup_timeout=180):
            harness.mkdtemp = original  # type: ignore[attr-defined]
            for name in skip:
                os.environ.pop(name, None)
            yield
    finally:
        harness.mkdtemp = original  # type: ignore[attr-defined]
        for name in skip:
            os.environ.pop(name, None)
