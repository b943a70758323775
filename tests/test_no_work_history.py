"""The project's documents and code describe the project, never how it was made: no session,
issue or round of work is named in the README, the docs, comments, docstrings or pyproject.toml
(history lives in git)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HISTORY = re.compile(r"\bsessions? \d+|\bissue #?\d+|\b(last|this|previous|earlier) (round|session)\b"
                     r"|\bwork history\b", re.IGNORECASE)
SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".sh", ".cfg", ".txt", ""}


def _tracked() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    return [ROOT / rel for rel in listed if rel and (ROOT / rel).is_file() and Path(rel).suffix in SUFFIXES
            and not rel.startswith(("tests/fixtures/", "benchmarks/results/"))]


def test_no_document_or_comment_speaks_of_its_own_work_history() -> None:
    me = Path(__file__).resolve()
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}"
             for path in _tracked() if path.resolve() != me
             for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if HISTORY.search(line)]
    assert found == []
