"""`retrain run` as a user runs it: a real subprocess with its own ephemeral Prefect server."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from retrain_cli.temp_server import empty_database_copy, is_migrated
from tests.conftest import small_overrides
from tests.kill import _worker_pids

pytestmark = pytest.mark.slow


def _retrain(args: list[str], cwd: Path, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "retrain_cli.main", "run", *args], cwd=cwd, capture_output=True, text=True,
        timeout=600, **kwargs,
    )


def _sets(overrides: list[str]) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def test_ui_without_a_run_history_is_one_line(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "retrain_cli.main", "ui", "--set", f"storage.root={tmp_path / 'none'}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"retrain: error: no run history at {tmp_path / 'none' / 'prefect' / 'server.db'}: `retrain run` records runs "
        "there when it starts its own temporary Prefect server; runs on a configured server are in that server's UI"]


def test_second_run_shows_cached_preprocessing_and_the_champion_scores(tmp_path: Path, demo_source: Path, prefect_server) -> None:
    args = _sets(small_overrides(tmp_path / "root", demo_source))
    # A running server: the temporary one's start-up is covered by the other CLI tests.
    first = _retrain(args, tmp_path, env=prefect_server.env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "  phases      imports " in first.stdout  # where the time went (report.json's phases)
    report = json.loads(Path(first.stdout.splitlines()[-1]).read_text())
    assert report["phases"]["train"] > 0 and report["phases"]["child_start"] > 0
    # Nothing changed: the finished run's report, without Prefect or a flow run.
    again = _retrain(args, tmp_path, env=prefect_server.env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing it depends on changed" in again.stderr and "loading Prefect" not in again.stderr
    assert again.stdout.splitlines()[-1] == first.stdout.splitlines()[-1]
    second = _retrain([*args, "--force"], tmp_path, env=prefect_server.env)  # the flow, every stage done
    assert second.returncode == 0, second.stderr[-3000:]
    assert "preprocess  Cached" in second.stdout
    assert "already complete" in second.stdout
    assert first.stdout.splitlines()[-1] == second.stdout.splitlines()[-1]

    # The champion in use: `retrain predict` scores new data with it, in its own process: no
    # Prefect server is configured, running or started for it.
    predict = [sys.executable, "-m", "retrain_cli.main", "predict", "--input", str(demo_source), "--output",
               str(tmp_path / "scores.parquet"), "--keys", "clicked", *args]
    no_server = {k: v for k, v in prefect_server.env.items() if k != "PREFECT_API_URL"}
    scored = subprocess.run(predict, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=no_server)
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert scored.stdout.strip().splitlines()[-1] == str(tmp_path / "scores.parquet")
    assert "Prefect" not in scored.stderr, scored.stderr
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "scores.parquet")
    assert table.column_names == ["clicked", "probability", "prediction"] and table.num_rows == 8000
    assert "scored 8000 rows with model" in scored.stderr  # a rerun is a no-op: tests/training/model/test_predict.py
    # --flow: the same scoring as the Prefect flow `predict`, recorded on the server; its output
    # already holds these scores.
    flowed = subprocess.run([*predict, "--flow"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                            env=prefect_server.env)
    assert flowed.returncode == 0, flowed.stderr[-3000:]
    assert "already scored: 8000 rows" in flowed.stdout + flowed.stderr
    assert flowed.stdout.strip().splitlines()[-1] == str(tmp_path / "scores.parquet")


def test_config_error_is_one_line_and_starts_nothing(tmp_path: Path) -> None:
    out = _retrain(["--set", "train.batch_size=0", "--set", "train.bogus=1"], tmp_path)
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.batch_size" in lines[0] and "unknown key 'train.bogus'" in lines[0]
    assert not (tmp_path / ".retrain").exists()


def test_data_error_is_one_line_naming_the_column(tmp_path: Path, demo_source: Path, prefect_server) -> None:
    args = _sets(small_overrides(tmp_path / "root", demo_source)) + ["--set", "data.numeric=[price, nope]"]
    out = _retrain(args, tmp_path, env=prefect_server.env)  # a running server: no start-up to wait for
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("retrain: error: ") and "'nope'" in last and demo_source.name in last


def _bad_copy(demo_source: Path, dest: Path, column: str, values: object) -> Path:
    import pyarrow.parquet as pq

    table = pq.read_table(demo_source)
    bad = table.set_column(table.schema.get_field_index(column), column, values(table.num_rows) if callable(values)
                           else values)
    dest.mkdir(parents=True, exist_ok=True)
    pq.write_table(bad, dest / "bad.parquet", row_group_size=2000)  # several parts: mapped packing
    return dest / "bad.parquet"


@pytest.mark.parametrize("case", ["string-label", "null-typed-column"])
def test_bad_data_found_while_packing_parts_is_one_line_and_leaves_nothing(
        tmp_path: Path, demo_source: Path, case: str, prefect_server) -> None:
    import pyarrow as pa

    if case == "string-label":
        source = _bad_copy(demo_source, tmp_path / "src", "clicked",
                           # Two classes, then a stray third value in the last part only.
                           lambda n: pa.array(["maybe" if i == n - 1 else "yes" if i % 2 else "no" for i in range(n)]))
        named = "clicked"
    else:
        source = _bad_copy(demo_source, tmp_path / "src", "price", lambda n: pa.nulls(n))
        named = "price"
    # data.task given: a three-valued string label would otherwise be inferred multiclass and train.
    args = _sets(small_overrides(tmp_path / "root", source) + ["data.pack_parts=4", "data.task=binary"])
    out = _retrain(args, tmp_path, env=prefect_server.env)  # a running server: no start-up to wait for
    assert out.returncode == 2, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("retrain: error: ") and named in last, last
    assert "Traceback" not in out.stderr and "TypeError" not in out.stderr, out.stderr[-3000:]
    datasets = tmp_path / "root" / "datasets"
    assert not list(datasets.glob("**/.partial-*"))  # nothing half-written left
    assert not list(datasets.glob("*/manifest.json"))  # and no dataset of bad data


def test_plan_prints_the_cheapest_instance_meeting_the_deadline(tmp_path: Path, demo_source: Path) -> None:
    cfg = tmp_path / "prices.yaml"
    cfg.write_text(
        "cost:\n  prices:\n"
        "    slow-cheap: {gpus: 1, on_demand_per_hour: 1.40, relative_speed: 1.0}\n"
        "    fast-dear: {gpus: 1, on_demand_per_hour: 4.00, relative_speed: 2.2}\n"
    )
    args = ["--config", str(cfg), *_sets(small_overrides(tmp_path / "root", demo_source)),
            "--instance-types", "slow-cheap,fast-dear", "--calibration-steps", "20"]
    out = subprocess.run([sys.executable, "-m", "retrain_cli.main", "plan", *args, "--deadline-hours", "5", "--json"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads(out.stdout)  # --json: the plan alone on stdout
    assert plan["cheapest"]["instance_type"] == "slow-cheap" and plan["why"]
    assert {r["instance_type"] for r in plan["rows"]} == {"slow-cheap", "fast-dear"}


def test_plan_picks_a_cloud_cpu_for_the_demo_when_no_local_machine_is_offered(tmp_path: Path,
                                                                              demo_source: Path) -> None:
    """The demo's small MLP runs a step in milliseconds on a core: a CPU instance at a few cents
    an hour is cheaper than any GPU, whose step is bound by the host launching kernels."""
    from training.config.prices import DEFAULT_PRICES

    types = ",".join(name for name in DEFAULT_PRICES if name != "local-cpu")
    args = [*_sets(small_overrides(tmp_path / "root", demo_source)), "--instance-types", types,
            "--calibration-steps", "60"]
    out = subprocess.run([sys.executable, "-m", "retrain_cli.main", "plan", *args, "--json"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads(out.stdout)
    assert plan["cheapest"]["instance_type"].startswith("c6i."), plan["why"]
    cpu = plan["cheapest"]
    assert "core(s)" in cpu["step_source"] and "CPU time" in cpu["step_source"] and cpu["step_seconds"][1] > 0


def _servers_of(root: Path) -> list[int]:
    """Prefect server processes whose database lives under `root` (the CLI's temporary server)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if b"uvicorn" in cmdline and str(root).encode() in environ:
                pids.append(int(entry))
    return pids


def _started_from_the_empty_copy(stderr: str, had_copy: bool) -> None:
    """A new root's temporary server starts from the empty copy when there is one, and keeps
    one when there is not; the copy holds no runs, whatever ran on the servers made from it."""
    copy = empty_database_copy()
    assert (f"(its database copied from {copy})" in stderr) == had_copy, stderr[-3000:]
    assert is_migrated(copy)
    with sqlite3.connect(f"file:{copy}?mode=ro", uri=True) as db:
        (runs,) = db.execute("SELECT count(*) FROM flow_run").fetchone()
    db.close()
    assert runs == 0


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _checkpoints(root: Path) -> set[str]:
    return {p.name for p in root.glob("runs/*/checkpoints/step-*[0-9]")}


def _stop_once_it_trains(args: list[str], cwd: Path, root: Path, stop: Callable[[int], None]) -> tuple[int, str]:
    """`retrain run` stopped by `stop(pid)` once this attempt wrote a checkpoint of its own, so
    that the stop lands while it trains, however loaded the machine; its exit code and stderr."""
    before = _checkpoints(root)
    # A terminal's foreground job has SIGINT at its default; a test session started in the
    # background of a non-interactive shell hands its children SIGINT ignored.
    proc = subprocess.Popen([sys.executable, "-m", "retrain_cli.main", "run", *args], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=_default_sigint)
    deadline = time.time() + 300
    while not _checkpoints(root) - before and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[1][-3000:]  # it ended before it trained
    stop(proc.pid)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


def _said_interrupted(code: int, err: str, expected: int) -> None:
    assert code == expected, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("retrain: interrupted (") and "checkpoint saved; run the same command again" in last, last
    assert "Traceback" not in err, err[-3000:]


def test_a_cli_stopped_by_ctrl_c_sigterm_or_sigkill_resumes_on_rerun(tmp_path: Path, demo_source: Path) -> None:
    """One run stopped three ways in turn, each time while it trains, then finished by a rerun of
    the same command; each attempt starts (and takes down) a temporary Prefect server."""
    root = tmp_path / "root"
    # Long enough that each stop lands while the attempt trains: what follows its checkpoint
    # takes a few seconds at most.
    args = _sets(small_overrides(root, demo_source) + ["train.max_steps=1500", "train.eval_every=500",
                                                       "train.checkpoint.every=10", "train.patience=0"])
    had_copy = empty_database_copy().exists()
    # Ctrl-C: what a terminal sends, to the whole foreground group.
    code, err = _stop_once_it_trains(args, tmp_path, root, lambda pid: os.killpg(pid, signal.SIGINT))
    _said_interrupted(code, err, 130)
    assert "preempted" not in err and "rescheduled flow run" not in err, err[-3000:]  # the user's stop
    assert not _servers_of(root)  # the temporary server went with it
    _started_from_the_empty_copy(err, had_copy)
    # SIGTERM to the CLI alone (a container's stop): the CLI stops its flow and its server.
    code, err = _stop_once_it_trains(args, tmp_path, root, lambda pid: os.kill(pid, signal.SIGTERM))
    _said_interrupted(code, err, 75)
    assert not _servers_of(root)
    # SIGKILL to the whole group: nothing runs after it, and the temporary server (a session of
    # its own) follows its parent.
    code, _ = _stop_once_it_trains(args, tmp_path, root, lambda pid: os.killpg(pid, signal.SIGKILL))
    assert code == -signal.SIGKILL
    deadline = time.time() + 120
    while _servers_of(root) and time.time() < deadline:
        time.sleep(0.1)
    assert not _servers_of(root)
    deadline = time.time() + 30
    while _worker_pids(str(root / "runs")) and time.time() < deadline:
        time.sleep(0.05)

    again = _retrain(args, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    report = json.loads(Path(again.stdout.strip().splitlines()[-1]).read_text())
    assert report["status"] == "completed" and len(report["resumed_from_steps"]) == 3, report["resumed_from_steps"]
    assert "resumed from steps" in again.stdout
    # The SIGTERM and the SIGKILL count as preemptions; the user's Ctrl-C is not a spot reclaim,
    # nor its cost.
    assert report["preemptions"] == 2


def test_a_running_local_server_is_used_instead_of_a_temporary_one(tmp_path: Path, demo_source: Path,
                                                                    prefect_server) -> None:
    """`prefect server start` in another terminal (here on the port its settings name): the CLI
    finds it, starts no server of its own, and the run is in that server's history."""
    env = {k: v for k, v in prefect_server.env.items() if k != "PREFECT_API_URL"}
    env["PREFECT_SERVER_API_PORT"] = str(prefect_server.port)
    root = tmp_path / "root"
    out = _retrain(_sets(small_overrides(root, demo_source) + ["train.max_steps=20"]), tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"using the Prefect server already running at {prefect_server.api_url}" in out.stderr
    assert not (root / "prefect" / "server.db").exists()
    report = json.loads(Path(out.stdout.strip().splitlines()[-1]).read_text())
    with prefect_server.api() as api:
        run = api.get(f"/flow_runs/{report['prefect_flow_run_id']}").json()
    assert run["state"]["type"] == "COMPLETED"


def test_a_full_disk_while_packing_parts_is_one_line_and_leaves_nothing(
        tmp_path: Path, demo_source: Path, prefect_server) -> None:
    """Segments packed at once on a full disk: one line naming the shard, and no partial segment
    left filling the disk."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.conftest import small_filesystem

    table = pq.read_table(demo_source)
    source = tmp_path / "src" / "big.parquet"
    source.parent.mkdir()
    pq.write_table(pa.concat_tables([table] * 8), source, row_group_size=8000)  # 64,000 rows, 8 segments
    with small_filesystem(tmp_path / "disk", 768) as disk:
        args = _sets(small_overrides(disk / "root", source) + ["data.pack_parts=4", "data.segment_rows=8000"])
        out = _retrain(args, tmp_path, env=prefect_server.env)
        assert out.returncode == 2, out.stderr[-3000:]
        last = out.stderr.strip().splitlines()[-1]
        assert last.startswith("retrain: error: cannot write shard ") and "No space left" in last, last
        assert "Traceback" not in out.stderr, out.stderr[-3000:]
        datasets = disk / "root" / "datasets"
        assert not list(datasets.glob("**/.partial-*"))  # the partial segments are gone
        assert not list(datasets.glob("*/manifest.json"))
