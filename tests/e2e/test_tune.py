"""`retrain tune` as a user runs it, against a running Prefect server: a budgeted study that
prunes, a study SIGKILLed twice that ends exactly like an uninterrupted one, and a budget too
small for one rung."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from training.config import load_config
from tests.kill import descendant_workers

pytestmark = pytest.mark.slow

MAX_USD = 0.05


def _study_config(tmp_path: Path, demo_source: Path, **tune: Any) -> Path:
    config = {
        "storage": {"root": str(tmp_path / "root")},
        "data": {"source": str(demo_source), "rows_per_member": 256, "shard_size_mb": 0.06},
        "model": {"hidden": [64, 32], "embedding_dim": 4},
        "train": {"max_steps": 120, "eval_every": 40, "checkpoint": {"every": 40}, "batch_size": 512,
                  "schedule": {"warmup_steps": 5}, "loader": {"num_workers": 0, "torch_threads": 1}, "patience": 0,
                  "retry": {"delay_seconds": 0}},
        # A priced instance: the budget is in dollars.
        "cost": {"instance_type": "g4dn.xlarge", "market": "spot"},
        "tune": {"space": {"train.optim.lr": "loguniform(1e-3, 3e-2)", "model.dropout": "uniform(0, 0.3)"},
                 "max_trials": 4, "min_resource": 40, "reduction_factor": 3, "max_usd": MAX_USD, "seed": 3, **tune},
    }
    path = tmp_path / "tune.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _tune(config: Path, env: dict[str, str], *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "retrain_cli.main", "tune", "--config", str(config), *extra],
                            cwd=config.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=600)
    return proc.returncode, out, err


def _report(stdout: str) -> dict[str, Any]:
    return json.loads(Path(stdout.strip().splitlines()[-1]).read_text())


def _trials(report: dict[str, Any]) -> list[tuple[Any, ...]]:
    """What must not depend on interruptions: parameters, state and every rung value."""
    return [(t["number"], json.dumps(t["params"], sort_keys=True), t["state"], t["steps"],
             sorted(t["rung_values"].items())) for t in report["trials"]]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, demo_source: Path, prefect_server) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("study")
    config = _study_config(folder, demo_source)
    code, out, err = _finish(_tune(config, prefect_server.env))
    assert code == 0, err[-3000:]
    return {"config": config, "stdout": out, "report": _report(out), "root": folder / "root"}


def test_a_study_completes_within_its_budget_and_prunes(uninterrupted: dict[str, Any], prefect_server) -> None:
    report = uninterrupted["report"]
    assert report["status"] == "complete" and len(report["trials"]) == 4
    assert 0 < report["spend"]["usd"] <= MAX_USD
    assert report["spend"]["usd"] == pytest.approx(sum(t["usd"] for t in report["trials"]) + (sum(
        report["spend"]["setup_seconds"].values()) + report["spend"]["seed_seconds"]) * report["rate_per_hour"] / 3600)
    states = [t["state"] for t in report["trials"]]
    # The pruner prunes: some trials stop at the first rung, the promoted ones train to the end.
    assert any(t["state"] == "pruned" and t["steps"] == 40 for t in report["trials"]), states
    assert "completed" in states and all(t["steps"] == 120 for t in report["trials"] if t["state"] == "completed")
    assert report["naive"]["usd"] > report["spend"]["usd"]
    # A small table (under 10,000 training rows): the config as given and the best others were
    # retrained with two more seeds, and the answer ranked by the mean.
    finished = [t for t in report["trials"] if t["state"] in ("completed", "early_stopped")]
    assert sorted(len(t["seed_values"]) for t in finished)[-min(3, len(finished)):] == [2] * min(3, len(finished))
    assert report["best"]["seeds"] == 3 and report["spend"]["seed_seconds"] > 0
    # The best trial's config is a config `retrain run` accepts, with the best parameters.
    best = report["best"]
    config = load_config(best["config"])
    assert config.train.optim.lr == best["params"]["train.optim.lr"] and config.model.dropout == best["params"]["model.dropout"]
    folder = Path(best["config"]).parent
    assert (folder / "tune_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert "best        trial" in uninterrupted["stdout"]
    # tune.promote (on by default): the answer went through the champion gate, in this empty root
    # after the config as given when it is another trial; the CLI says what the gate decided.
    gate = report["gate"]
    base = next((t["number"] for t in report["trials"] if t["base"]), None)
    assert gate["trial"] == best["trial"] and gate["base_first"] == (base is not None and best["trial"] != base)
    champion = json.loads((uninterrupted["root"] / "models" / "champion").read_text())
    assert gate["promoted"] == (champion["sha256"] == json.loads(Path(gate["report"]).read_text())["model"]["sha256"])
    assert f"trial {best['trial']}" in next(line for line in uninterrupted["stdout"].splitlines()
                                            if line.startswith("  champion    "))
    # The trials table and the report (with its plot) are Prefect artifacts of the flow run.
    with prefect_server.api() as api:
        found = api.post("/artifacts/filter", json={"artifacts": {"key": {"any_": ["tune-trials", "tune-report"]}}})
    artifacts = {a["key"]: a for a in found.json()}
    assert set(artifacts) == {"tune-trials", "tune-report"}, found.text[:500]
    assert "data:image/png;base64," in artifacts["tune-report"]["data"]


def test_a_finished_study_rerun_is_reported_complete_without_training(uninterrupted: dict[str, Any],
                                                                     prefect_server) -> None:
    started = {p: p.read_text() for p in uninterrupted["root"].glob("runs/*/processes-started")}
    code, out, err = _finish(_tune(uninterrupted["config"], prefect_server.env))
    assert code == 0, err[-3000:]
    again = _report(out)
    assert again["status"] == "complete" and _trials(again) == _trials(uninterrupted["report"])
    assert {p: p.read_text() for p in uninterrupted["root"].glob("runs/*/processes-started")} == started


def _heartbeats(root: Path) -> dict[Path, int]:
    steps = {}
    for beat in root.glob("runs/*/heartbeat.bin"):
        data = beat.read_bytes()
        if len(data) == 16:
            steps[beat.parent] = struct.unpack("<qd", data)[0]
    return steps


def _kill_when(proc: subprocess.Popen[str], root: Path, mid_rung: Any) -> None:
    """SIGKILL the CLI and its training child (a machine gone) once `mid_rung(heartbeats)`."""
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        run = mid_rung(_heartbeats(root))
        if run is not None:
            workers = descendant_workers(proc.pid)
            assert workers, "the study's training child was not found"
            for pid in workers:
                os.kill(pid, signal.SIGKILL)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return
        time.sleep(0.005)
    raise AssertionError(f"no kill point reached:\n{proc.stderr.read() if proc.stderr else ''}")


def test_a_study_killed_twice_ends_like_an_uninterrupted_one(tmp_path: Path, demo_source: Path,
                                                              uninterrupted: dict[str, Any], prefect_server) -> None:
    config = _study_config(tmp_path, demo_source, seeds=0)  # the trials are compared; retrains come after them
    root = tmp_path / "root"
    # Told the server is private to these runs, the flow holds only the root's own lock (freed
    # when its holder dies), not the server's global concurrency slot, whose 60 s lease a
    # killed holder keeps (that wait is tested with the deployments). The kills stay real.
    env = {**prefect_server.env, "RETRAIN_TEMPORARY_PREFECT_SERVER": prefect_server.api_url}
    # First kill: the first trial between its first and second rung (past step 40's checkpoint).
    _kill_when(_tune(config, env), root,
               lambda beats: next((run for run, step in beats.items() if 60 <= step < 120), None))
    # Second kill: a later trial in the middle of its first rung.
    first_run = set(_heartbeats(root))
    _kill_when(_tune(config, env), root,
               lambda beats: next((run for run, step in beats.items() if run not in first_run and 10 <= step < 40), None))
    code, out, err = _finish(_tune(config, env))
    assert code == 0, err[-3000:]
    report = _report(out)
    assert report["status"] == "complete"
    assert _trials(report) == _trials(uninterrupted["report"])
    # The lost work is counted: steps lost by the two kills, billed with the trials' runs.
    assert sum(t["steps_lost"] for t in report["trials"]) >= 2 * 10
    assert sum(t["preemptions"] for t in report["trials"]) >= 2


def test_a_budget_smaller_than_one_rung_is_refused_before_any_trial(tmp_path: Path, demo_source: Path,
                                                                    prefect_server) -> None:
    config = _study_config(tmp_path, demo_source, max_usd=1e-7)
    # A full trial of hours on this CPU: the warning that says so comes before the refusal, since
    # it says why a bigger budget may be the wrong answer.
    config.write_text(config.read_text().replace("max_steps: 120", "max_steps: 100000000"))
    code, out, err = _finish(_tune(config, prefect_server.env))
    assert code == 2 and out == ""
    lines = [line for line in err.splitlines() if line.startswith("retrain: error")]
    assert len(lines) == 1 and "tune.max_usd=1e-07 cannot pay for the first rung" in lines[0], err[-3000:]
    assert "one trial at full fidelity takes about" in err.split(lines[0])[0], err[-3000:]
    assert "Traceback" not in err
    assert not list((tmp_path / "root").glob("runs/*"))
