"""Every shell command of the README and the docs pages runs, and its documented output holds.

One test per page (the pages' commands run in order, in a folder of their own); the marks
that keep a block from running must say why. See tests/e2e/docs_commands.py for how a page runs.
A page's first block whose text already passed on an earlier page (the same command, in a folder
of its own) is not run twice.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import boto3
import pytest

from retrain_cli.temp_server import free_port, server_is_up
from tests.e2e.conftest import PrefectServer, running_server
from tests.postgres import PostgresCluster
from tests.e2e.docs_commands import Block, blocks, buckets, environment, pages, run_block, runnable, work_folder

pytestmark = pytest.mark.slow
RUN = [page for page in pages() if runnable(page)]
# The README's quick start runs as a new user runs it, with no Prefect server (the command
# starts a temporary one), and what its summary promises is checked on that run.
QUICK_START = ("README.md", "retrain run")
# The text of each block that passed in this test run, with where: a later page's block of the
# same text (the same command from a folder of its own) has been proven by it.
PASSED: dict[str, str] = {}


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
        if (page, block.text.strip()) == QUICK_START:
            out = run_block(block, cwd, {k: v for k, v in env.items() if k != "PREFECT_API_URL"})
            assert out is not None
            _the_quick_start_keeps_its_promises(out, cwd / ".retrain")
        elif block.text in PASSED and not _reads_what_earlier_blocks_wrote(page, block):
            print(f"docs command: {block.where} is {PASSED[block.text]}, which passed")
        else:
            run_block(block, cwd, env)
        PASSED.setdefault(block.text, block.where)


def _reads_what_earlier_blocks_wrote(page: str, block: Block) -> bool:
    """A block after others on its page may read what they wrote: it runs again."""
    return runnable(page)[0] != block


def _the_quick_start_keeps_its_promises(out: subprocess.CompletedProcess[str], root: Path) -> None:
    report_path = Path(out.stdout.strip().splitlines()[-1])
    assert report_path.is_absolute() and report_path.is_relative_to(root), out.stdout[-2000:]
    report = json.loads(report_path.read_text())
    assert report["status"] in ("completed", "early_stopped")
    assert 0.5 < report["metrics"]["auc"] <= report["bayes_auc"] + 0.01
    assert "Bayes-optimal AUC" in out.stdout
    # Its temporary server is gone: no link to it, but the command that opens the UI over the
    # root's run history, which then shows this run.
    assert "View at" not in out.stdout + out.stderr
    assert f"  ui          retrain ui --set storage.root={root}" in out.stdout
    _the_ui_shows_the_run(root, report["prefect_flow_run_id"])


def _the_ui_shows_the_run(root: Path, flow_run_id: str) -> None:
    port = free_port()
    ui = subprocess.Popen([sys.executable, "-m", "retrain_cli.main", "ui", "--set", f"storage.root={root}", "--port",
                           str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not server_is_up(f"http://127.0.0.1:{port}/api"):
            assert ui.poll() is None and time.monotonic() < deadline, ui.communicate()
            time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/flow_runs/{flow_run_id}") as response:
            assert json.loads(response.read())["id"] == flow_run_id
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ui-settings") as response:
            assert json.loads(response.read())["api_url"] == f"http://127.0.0.1:{port}/api"  # not 4200's
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/") as response:
            assert b"<!DOCTYPE html>" in response.read()  # the UI itself
    finally:
        ui.send_signal(signal.SIGINT)
        try:
            ui.wait(timeout=30)
        except subprocess.TimeoutExpired:
            ui.kill()
            ui.wait()


def test_every_page_with_commands_is_run_or_says_why_not() -> None:
    shells = [b for page in pages() for b in blocks(page) if b.lang in ("bash", "console", "sh", "shell")]
    assert [b.where for b in shells if b.lang not in ("bash", "console")] == [], "use ```bash or ```console"
    assert all(b.not_run is None or len(b.not_run) > 10 for b in shells), "a not-run mark needs its reason"
    assert "README.md" in RUN
