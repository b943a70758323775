"""What a benchmark result measured: a hash of the code its figures depend on, kept in the result
and compared with the tree's when the page is generated, so that a figure measured on code that
has since changed is marked stale. Content, not commits: a shallow clone or a copy of the tree
without its .git (the GPU machine's) hashes the same."""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["MEASURED", "code_sha"]

ROOT = Path(__file__).resolve().parents[1]
# What a benchmark's figures depend on besides its own module: the product's packages, the
# pinned dependencies and the runner's shared helpers.
MEASURED = ("training", "tasks", "flows", "retrain_cli", "constraints.txt", "benchmarks/common.py")


def code_sha(stem: str, root: Path = ROOT) -> str:
    """sha256 over the paths and bytes of the Python files (and pins) `stem`'s figures depend on."""
    digest = hashlib.sha256()
    for rel in sorted(_files(root, [*MEASURED, f"benchmarks/bench_{stem}.py"])):
        digest.update(rel.encode() + b"\0" + (root / rel).read_bytes() + b"\0")
    return digest.hexdigest()


def _files(root: Path, paths: list[str]) -> list[str]:
    found = []
    for rel in paths:
        path = root / rel
        if path.is_file():
            found.append(rel)
        elif path.is_dir():
            found += [str(p.relative_to(root)) for p in path.rglob("*.py") if "__pycache__" not in p.parts]
    return found
