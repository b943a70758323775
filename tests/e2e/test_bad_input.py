"""Damaged files under the root and bad input at the command line, as a user meets them: each
case is one `retrain: error:` line and exit 2 (no traceback), or, where the damage is to derived
data the pipeline can rebuild, a run that heals it and succeeds.

One trained root is made per module and copied for each case."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import small_overrides

pytestmark = pytest.mark.slow


def _cli(command: str, args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "retrain_cli.main", command, *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600, env=env)


def _sets(overrides: list[str]) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def _one_error_line(out: subprocess.CompletedProcess[str], *named: str) -> str:
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("retrain: error: "), last
    for name in named:
        assert name in last, last
    return last


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, demo_source: Path, prefect_server) -> Path:
    """A root holding one finished run and its promoted champion."""
    base = tmp_path_factory.mktemp("trained")
    out = _cli("run", _sets(small_overrides(base / "root", demo_source)), base, prefect_server.env)
    assert out.returncode == 0, out.stderr[-3000:]
    return base / "root"


def _copy(trained: Path, tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(trained, root, symlinks=True, ignore=shutil.ignore_patterns("prefect"))
    return root


def test_a_damaged_champion_pointer_never_blocks_retraining(trained: Path, tmp_path: Path, demo_source: Path,
                                                            prefect_server) -> None:
    """A folder where the pointer belongs: the run starts fresh and promotes, writing a pointer in
    its place. Each way a pointer can be damaged is tests/training/model/test_model_ref.py's."""
    root = _copy(trained, tmp_path)
    pointer = root / "models" / "champion"
    pointer.unlink()
    pointer.mkdir()
    out = _cli("run", [*_sets(small_overrides(root, demo_source)), "--force"], tmp_path, prefect_server.env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "champion    PROMOTED" in out.stdout and "is unusable" in out.stdout, out.stdout
    assert json.loads(pointer.read_text())["sha256"]  # a pointer again


def test_a_damaged_result_json_is_set_aside_and_the_run_finished_again(trained: Path, tmp_path: Path,
                                                                      demo_source: Path, prefect_server) -> None:
    """A truncated record: set aside, and the run finished again from its checkpoints to the same
    model. Each way a record can be damaged is tests/training/launch/test_runs.py's."""
    root = _copy(trained, tmp_path)
    (result,) = root.glob("runs/*/result.json")
    good = json.loads(result.read_text())
    result.write_bytes(result.read_bytes()[:100])
    out = _cli("run", [*_sets(small_overrides(root, demo_source)), "--force"], tmp_path, prefect_server.env)
    assert out.returncode == 0, out.stderr[-3000:]
    healed = json.loads(result.read_text())
    assert healed["model"]["sha256"] == good["model"]["sha256"] and healed["history"] == good["history"]
    assert "is damaged" in out.stderr


def test_duplicate_source_columns_are_one_line_naming_the_file_and_column(tmp_path: Path, demo_source: Path,
                                                                          prefect_server) -> None:
    table = pq.read_table(demo_source)
    doubled = pa.table([*table.columns, table.column("price")], names=[*table.column_names, "price"])
    source = tmp_path / "doubled.parquet"
    pq.write_table(doubled, source)
    out = _cli("run", _sets(small_overrides(tmp_path / "root", source)), tmp_path, prefect_server.env)
    _one_error_line(out, "doubled.parquet", "'price' appears 2 times")


@pytest.mark.parametrize("case", ["factory-raises", "too-large"])
def test_a_model_that_cannot_be_built_is_one_line(tmp_path: Path, demo_source: Path, prefect_server,
                                                  case: str) -> None:
    extra = (["model.factory=tests.model_factories:raises"] if case == "factory-raises"
             else ["model.hidden=[2000000, 2000000]"])
    out = _cli("run", _sets([*small_overrides(tmp_path / "root", demo_source), *extra]), tmp_path,
               prefect_server.env)
    if case == "factory-raises":
        _one_error_line(out, "model.factory 'tests.model_factories:raises' raised ValueError", "no such layer")
    else:
        _one_error_line(out, "does not fit in memory", "model.hidden")


def test_predict_refuses_an_output_that_is_a_folder_or_its_input(trained: Path, tmp_path: Path, demo_source: Path,
                                                                 prefect_server) -> None:
    root = _copy(trained, tmp_path)
    args = _sets(small_overrides(root, demo_source))
    folder = tmp_path / "out"
    folder.mkdir()
    out = _cli("predict", ["--input", str(demo_source), "--output", str(folder), *args], tmp_path, prefect_server.env)
    _one_error_line(out, f"--output {folder} is a folder")
    data = tmp_path / "data.parquet"
    shutil.copy(demo_source, data)
    before = data.read_bytes()
    out = _cli("predict", ["--input", str(data), "--output", str(tmp_path / "." / "data.parquet"), *args], tmp_path,
               prefect_server.env)
    _one_error_line(out, "is the input file")
    assert data.read_bytes() == before


def test_a_prefect_server_that_does_not_answer_is_one_line(tmp_path: Path, demo_source: Path, prefect_server) -> None:
    """As after `retrain ui` stops: Prefect's banner told the user to set PREFECT_API_URL."""
    from retrain_cli.temp_server import free_port

    env = {**prefect_server.env, "PREFECT_API_URL": f"http://127.0.0.1:{free_port()}/api"}
    out = _cli("run", _sets(small_overrides(tmp_path / "root", demo_source)), tmp_path, env)
    _one_error_line(out, "PREFECT_API_URL", "no Prefect server answers there")
