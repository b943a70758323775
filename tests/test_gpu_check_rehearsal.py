"""The GPU check's rehearsal on a CPU (`GPU_CHECK_QUICK=1`): every part of
`python -m benchmarks.run gpu` runs at toy sizes, the captured step's eager stand-in among them,
so the script a short GPU loan runs is known to work before the loan. It checks the script, not
a GPU: no figure of it is a GPU's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_every_part_of_the_gpu_check_runs_on_a_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "GPU_CHECK_QUICK": "1", "GPU_CHECK_WORK": str(tmp_path / "work"), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "benchmarks.run", "gpu", "--out", str(tmp_path / "out")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=1500)
    assert "== every part ok" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "out" / "gpu.json").read_text())
    assert result["graph_bit_identical_to_eager"] is True
    assert {row["ran_as"] for rows in result["busy_by_model"].values() for row in rows.values()} == {"eager",
                                                                                                     "capturable"}
    assert all(row["dollars_per_100k_steps"] is None for rows in result["busy_by_model"].values()
               for row in rows.values())  # no GPU, no GPU figure
