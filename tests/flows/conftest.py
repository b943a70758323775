from __future__ import annotations

from typing import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def prefect_harness() -> Iterator[None]:
    """One Prefect test server for every flow test (it takes 15-22 s to start here)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield
