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



def test_a_result_measured_on_other_code_is_marked_stale(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "docs"))
    import generate

    from benchmarks.provenance import code_sha

    assert generate._stale("packing", {"code_sha": code_sha("packing")}) is None
    assert generate._stale("packing", {"code_sha": "0" * 64}).startswith("the code it measures has changed since")
    assert generate._stale("packing", {"commit": "abc"}).startswith("its file names no hash of the code it measured")
    # A change to a measured module changes the hash; a change elsewhere does not.
    for rel in ("training/a.py", "benchmarks/bench_packing.py", "benchmarks/bench_peers.py", "docs/x.md"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    before = code_sha("packing", tmp_path)
    (tmp_path / "docs/x.md").write_text("changed")
    (tmp_path / "benchmarks/bench_peers.py").write_text("x = 2\n")
    assert code_sha("packing", tmp_path) == before
    (tmp_path / "training/a.py").write_text("x = 2\n")
    assert code_sha("packing", tmp_path) != before
