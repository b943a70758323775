"""The generated pages of the docs site (configuration and CLI references, benchmarks) are what
the code and the result files would generate now: a page cannot drift from what it describes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_generated_pages_are_current() -> None:
    out = subprocess.run([sys.executable, "docs/generate.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
