"""mypy over the product packages and the benchmarks (`[tool.mypy]` in pyproject.toml), as a test
of the suite: it takes a core for most of a minute, which on two workers runs beside the other
tests instead of before them all."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_code_type_checks() -> None:
    out = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, f"mypy found problems:\n{out.stdout[-6000:]}\n{out.stderr[-2000:]}"
