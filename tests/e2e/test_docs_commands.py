"""Every shell command of the README and the docs pages runs, and its documented output holds.

One test per page (the pages' commands run in order, in a folder of their own); the marks
that keep a block from running must say why. See tests/e2e/docs_commands.py for how a page runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import boto3
import pytest

from tests.e2e.conftest import PrefectServer, running_server
from tests.postgres import PostgresCluster
from tests.e2e.docs_commands import blocks, buckets, environment, pages, run_block, runnable, work_folder

pytestmark = pytest.mark.slow
RUN = [page for page in pages() if runnable(page)]


@pytest.fixture(scope="module")
def docs_server(tmp_path_factory: pytest.TempPathFactory, postgres: PostgresCluster) -> Iterator[PrefectServer]:
    """A server of this module's own: the pages create work pools and deployments by the names
    they document, which other tests' servers may already hold."""
    with running_server(tmp_path_factory.mktemp("docs-prefect-home"), postgres) as server:
        yield server


@pytest.mark.parametrize("page", RUN)
def test_the_commands_of_a_page_run(page: str, tmp_path: Path, docs_server: PrefectServer, s3_server: str) -> None:
    s3 = boto3.client("s3", endpoint_url=s3_server)
    for bucket in buckets(page):
        s3.create_bucket(Bucket=bucket)
    cwd = work_folder(tmp_path / "work")
    env = environment(docs_server.api_url, s3_server)
    for block in runnable(page):
        run_block(block, cwd, env)


def test_every_page_with_commands_is_run_or_says_why_not() -> None:
    shells = [b for page in pages() for b in blocks(page) if b.lang in ("bash", "console", "sh", "shell")]
    assert [b.where for b in shells if b.lang not in ("bash", "console")] == [], "use ```bash or ```console"
    assert all(b.not_run is None or len(b.not_run) > 10 for b in shells), "a not-run mark needs its reason"
    assert "README.md" in RUN
