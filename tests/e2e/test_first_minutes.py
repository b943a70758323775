"""A newcomer's first minutes at the command line: a wrong path, label, column or file type is
one line, with exit 2, before any Prefect server starts; their own Parquet file with a label and
a few columns trains with one command, its feature columns inferred and printed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest


def _cli(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "retrain_cli.main", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env=env)


def _newcomer_file(folder: Path) -> Path:
    rng = np.random.default_rng(0)
    x1, x2 = rng.normal(size=3000), rng.normal(size=3000)
    y = (x1 + 0.5 * x2 + rng.normal(size=3000) * 0.5 > 0).astype(np.int8)
    path = folder / "mine.parquet"
    pq.write_table(pa.table({"x1": x1, "x2": x2, "y": y}), path)
    return path


@pytest.mark.parametrize(("args", "named"), [
    (["--set", "data.source=nope.parquet"], "data.source nope.parquet does not exist"),
    (["--set", "data.source=mine.parquet", "--set", "data.label=yy"], "did you mean 'y'?"),
    (["--set", "data.source=mine.parquet", "--set", "data.label=y", "--set", "data.numeric=[x1, x3]"],
     "no column 'x3' (named by data.numeric); did you mean"),
    (["--set", "data.source=mine.csv", "--set", "data.label=yy"], "did you mean 'y'?"),  # CSV: the same checks
    (["--set", "train.max_step=3"], "unknown key 'train.max_step'; did you mean 'train.max_steps'?"),
], ids=["missing-path", "wrong-label", "wrong-column", "csv-wrong-label", "typo"])
def test_bad_input_is_one_line_before_any_server_starts(tmp_path: Path, args: list[str], named: str) -> None:
    _newcomer_file(tmp_path)
    (tmp_path / "mine.csv").write_text("x1,x2,y\n1,2,0\n")
    out = _cli(["run", *args, "--set", f"storage.root={tmp_path / 'root'}"], tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert lines == [lines[-1]] and lines[-1].startswith("retrain: error: ") and named in lines[-1], out.stderr
    assert not (tmp_path / "root" / "prefect").exists()  # no temporary server was started


def test_rungs_that_miss_the_validations_are_one_line_before_any_server_starts(tmp_path: Path) -> None:
    _newcomer_file(tmp_path)
    out = _cli(["tune", "--set", "data.source=mine.parquet", "--set", "data.label=y", "--set", "train.eval_every=40",
                "--set", "tune.min_resource=50", "--set", "tune.space={train.optim.lr: 'loguniform(1e-4, 1e-2)'}",
                "--set", f"storage.root={tmp_path / 'root'}"], tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert lines[-1].startswith("retrain: error: tune.min_resource (50) must be a multiple of train.eval_every (40)")
    assert not (tmp_path / "root" / "prefect").exists()  # no temporary server was started


@pytest.mark.slow
def test_a_newcomers_own_file_trains_with_one_command(tmp_path: Path, prefect_server) -> None:  # type: ignore[no-untyped-def]
    _newcomer_file(tmp_path)
    out = _cli(["run", "--set", "data.source=mine.parquet", "--set", "data.label=y", "--set", "storage.root=root",
                "--set", "train.max_steps=60"], tmp_path, prefect_server.env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--set data.numeric=[x1, x2] --set data.categorical=[]" in out.stderr
    assert "champion    PROMOTED" in out.stdout and out.stdout.strip().endswith("report.json")


@pytest.mark.parametrize("through_cli", [False, True], ids=["prefect-alone", "retrain"])
def test_no_telemetry_notice_in_a_terminal(tmp_path: Path, through_cli: bool) -> None:
    """Prefect prints a usage-data notice the first time it is imported in a terminal. The
    `retrain` command turns Prefect's usage data off for what it starts, so a newcomer's first
    command shows no notice about a server they never started. Without the command's package,
    the same terminal shows it: the check can see it."""
    import os
    import pty

    from prefect._internal.analytics import ci_detection

    # Prefect stays quiet on CI machines; the check runs as on a newcomer's laptop.
    ci = set(getattr(ci_detection, "CI_ENV_VARS", ())) | {"CI", "GITHUB_ACTIONS", "GITLAB_CI", "BUILDKITE"}
    env = {k: v for k, v in os.environ.items() if k != "DO_NOT_TRACK" and k not in ci}
    env["PREFECT_HOME"] = str(tmp_path / "home")  # a first run: no marker of an earlier notice
    code = ("import retrain_cli.main; " if through_cli else "") + "import prefect; print('imported')"
    main, child = pty.openpty()  # a terminal: Prefect shows the notice only in one
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=child, stdout=child, stderr=child, env=env)
    os.close(child)
    out = b""
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(main)
    assert proc.wait(timeout=120) == 0, out
    text = out.decode(errors="replace")
    assert "imported" in text
    assert ("anonymous usage data" in text) is not through_cli, text
