"""The shipped notifying automations on a real Prefect server: `retrain automations --notify`
installs them with the operator's notification block, and a message arrives for a failed run,
a crashed run that nothing rescheduled, a run its budget stopped, and a promotion."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from tests.e2e.conftest import ROOT, PrefectServer, wait_for

pytestmark = pytest.mark.slow

NOTIFYING = ("notify-failed-runs", "notify-crashed-runs", "notify-budget-stopped-runs", "notify-on-promotion")


@pytest.fixture
def webhook() -> Iterator[tuple[str, list[str]]]:
    """A local webhook receiver: its URL, and the bodies it was sent."""
    received: list[str] = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append(self.rfile.read(int(self.headers["Content-Length"])).decode())
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    hook = HTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{hook.server_port}/hook", received
    hook.shutdown()


def _python(server: PrefectServer, code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], env=server.env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _automations(server: PrefectServer, folder: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([sys.executable, "-m", "retrain_cli.main", "automations", "--dir", str(folder), *extra],
                         env=server.env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _arrived(received: list[str], *parts: str) -> str:
    return wait_for(lambda: next((text for text in received if all(p in text for p in parts)), None), 300,
                    f"a notification with {parts}")


def test_the_notifying_automations_send_their_messages(prefect_server: PrefectServer, tmp_path: Path,
                                                       webhook: tuple[str, list[str]]) -> None:
    url, received = webhook
    block = f"alerts-{uuid.uuid4().hex[:8]}"
    _python(prefect_server, "from prefect.blocks.notifications import CustomWebhookNotificationBlock as B\n"
                            f"B(name={block!r}, url={url!r}, json_data={{'text': '{{{{subject}}}} | {{{{body}}}}'}})"
                            f".save({block!r})")
    folder = tmp_path / "automations"
    folder.mkdir()
    for name in NOTIFYING:
        shutil.copy(ROOT / "deployments" / "automations" / f"{name}.yaml", folder)
    # The only change: a crash is waited on for 10 s here instead of 5 minutes.
    crashed = folder / "notify-crashed-runs.yaml"
    crashed.write_text(crashed.read_text().replace("within: 300", "within: 10"))

    skipped = _automations(prefect_server, folder)  # no block named: nothing that notifies is installed
    assert skipped.stdout.count("it notifies; pass --notify") == len(NOTIFYING), skipped.stdout
    installed = _automations(prefect_server, folder, "--notify", f"custom-webhook/{block}")
    assert installed.stdout.count("created automation") == len(NOTIFYING), installed.stdout
    try:
        _python(prefect_server, "from prefect import flow, tags\n"
                                "@flow(name='retrain-notify-check')\n"
                                "def fails():\n    raise ValueError('data.source /nowhere does not exist')\n"
                                "with tags('retrain'):\n"
                                "    fails(return_state=True)\n")
        failed = _arrived(received, "failed", "data.source /nowhere does not exist")
        assert "retrain: flow run" in failed and "of no deployment (retrain-notify-check)" in failed

        _python(prefect_server, "from prefect.events import emit_event\n"  # what tasks/artifacts.py emits
                                "emit_event(event='retrain.run.completed', resource={'prefect.resource.id': "
                                "'retrain.run.abc123', 'prefect.resource.name': 'abc123', 'retrain.run.status': "
                                "'budget_stopped'}, payload={'run_key': 'abc123', 'status': 'budget_stopped', "
                                "'stop_reason': 'budget.max_usd=1.0 would be exceeded', 'report': 's3://b/runs/abc123/report.json', "
                                "'steps': 420, 'cost_text': '$0.8123 of compute', 'metric_text': \"model's test auc is "
                                "0.8712\", 'flow_run_name': 'daily-0300-cd', 'deployment': 'retrain', "
                                "'flow_run_url': 'http://ui/runs/flow-run/cd'})\n"
                                "emit_event(event='retrain.run.completed', resource={'prefect.resource.id': "
                                "'retrain.run.def456', 'retrain.run.status': 'completed'}, payload={'run_key': 'def456'})")
        budget = _arrived(received, "abc123", "stopped at its budget")
        assert "budget.max_usd=1.0 would be exceeded" in budget and "s3://b/runs/abc123/report.json" in budget
        assert "flow run daily-0300-cd (retrain) stopped at its budget" in budget and "http://ui/runs/flow-run/cd" in budget
        assert "after 420 steps and $0.8123 of compute" in budget and "test auc is 0.8712" in budget

        with prefect_server.api() as api:
            flow_id = api.post("/flows/", json={"name": "retrain-crash-check"}).json()["id"]
            run = api.post("/flow_runs/", json={"flow_id": flow_id, "name": "lost-machine", "tags": ["retrain"],
                                                "state": {"type": "RUNNING"}}).json()
            api.post(f"/flow_runs/{run['id']}/set_state",
                     json={"state": {"type": "CRASHED", "message": "its machine was lost"}, "force": True})
        _arrived(received, "lost-machine", "crashed and was not rescheduled")

        sha = "cd" * 32
        _python(prefect_server, "from prefect.events import emit_event\n"  # what promotion_payload gives
                                f"emit_event(event='retrain.model.promoted', resource={{'prefect.resource.id': "
                                f"'retrain.model.{sha}'}}, payload={{'sha256': '{sha}', 'short': '{sha[:12]}', "
                                "'rmse': 52.55, 'metric': 'rmse', 'metric_text': 'test rmse 52.5500', "
                                "'previous_short': 'no champion', 'reason': 'first', 'flow_run_name': 'daily-0300-ab', "
                                "'deployment': 'retrain', 'flow_run_url': 'http://ui/runs/flow-run/ab'})")
        promoted = _arrived(received, f"new champion {sha[:12]}, test rmse 52.5500")
        assert sha not in promoted and "daily-0300-ab" in promoted and "http://ui/runs/flow-run/ab" in promoted
        assert not any("def456" in text for text in received)  # a completed run: nothing to say
    finally:
        with prefect_server.api() as api:
            for automation in api.post("/automations/filter", json={}).json():
                if automation["name"].startswith("retrain-notify-") or automation["name"] == "retrain-new-champion":
                    api.delete(f"/automations/{automation['id']}")
