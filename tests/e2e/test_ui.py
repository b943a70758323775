"""A person starts a run from the Prefect UI: Debian's Chromium, driven by Playwright."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest

from tests.conftest import small_overrides
from tests.e2e.conftest import POOL, ROOT, PrefectServer, deployment, flow_run
from training.config import load_config

pytestmark = pytest.mark.slow
CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = ROOT / "test-artifacts"


@pytest.mark.skipif(shutil.which("chromium") is None and not Path(CHROMIUM).exists(),
                    reason="Debian's chromium is not installed (.ci/run installs it)")
def test_custom_run_from_the_ui_completes(deployed: PrefectServer, tmp_path: Path, demo_source: Path) -> None:
    from playwright.sync_api import sync_playwright

    # The operator's deployment defaults: a small dataset and a throwaway root.
    dep = deployment(deployed, "retrain")
    config = load_config(overrides=small_overrides(tmp_path / "root", demo_source))
    with deployed.api() as api:
        api.patch(f"/deployments/{dep['id']}", json={"parameters": {"config": config.model_dump(mode="json")}}).raise_for_status()

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run"],
        )
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        # Playwright's 30 s ceiling is too short here: the server (SQLite, under two test workers'
        # flows) can stall for longer than that before the page after Submit loads.
        page.set_default_timeout(180_000)
        page.goto(f"{deployed.ui_url}/deployments")
        page.get_by_role("link", name="retrain", exact=True).first.click()
        page.get_by_role("button", name="Run", exact=True).click()
        page.get_by_text("Custom run").click()
        max_steps = (
            page.get_by_text("Max Steps (Optional)", exact=True)
            .locator("xpath=ancestor::div[.//input][1]")
            .locator("input")
            .first
        )
        max_steps.fill("40")  # the custom value
        max_steps.screenshot(path=str(ARTIFACTS / "prefect-ui-custom-value.png"))
        page.get_by_role("button", name="Submit").click()
        page.wait_for_url(re.compile(r"/deployments/deployment/[^/?]+\?tab=Runs"))
        page.get_by_text("Scheduled").first.wait_for()  # the new run is listed
        page.screenshot(path=str(ARTIFACTS / "prefect-ui-after-submit.png"), full_page=True)
        browser.close()

    with deployed.api() as api:
        runs = api.post("/flow_runs/filter", json={"deployments": {"id": {"any_": [dep["id"]]}},
                                                    "sort": "EXPECTED_START_TIME_DESC"}).json()
    ui_runs = [r for r in runs if r["parameters"]["config"]["train"]["max_steps"] == 40]
    assert len(ui_runs) == 1
    deployed.cli("worker", "start", "--pool", POOL, "--run-once", timeout=420)
    deadline = time.time() + 300
    while (run := flow_run(deployed, ui_runs[0]["id"]))["state"]["type"] not in ("COMPLETED", "FAILED", "CRASHED"):
        assert time.time() < deadline, run["state"]
        time.sleep(1)
    assert run["state"]["type"] == "COMPLETED", run["state"]
    (report,) = (tmp_path / "root" / "runs").glob("*/report.json")
    assert json.loads(report.read_text())["steps"] == 40
