"""The shell blocks of the README and the docs pages, run as a reader would run them.

A page's ```bash blocks run in order, each in `bash -euo pipefail`, in one working folder per
page (so a later block finds what an earlier one made), with the repository's files linked in.
A ```console block holds `$ command` lines, each followed by its documented output, which must
match (`...` stands for any text, as in doctest). A block that cannot run on a test machine (a
GPU, a cloud account, a registry, a second machine, a server that runs until stopped) is marked
`<!-- not run: reason -->` on the line above it.

Prefect runs against a server of the test's own and S3 against moto's server, both on
127.0.0.1; every bucket a page names is created first.
"""

from __future__ import annotations

import doctest
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Pages written by docs/generate.py hold no commands of their own.
GENERATED = {"docs/reference/config.md", "docs/reference/cli.md", "docs/benchmarks.md"}
FENCE = re.compile(r"^```(\w*)\s*$")
NOT_RUN = re.compile(r"^<!-- not run: (.+) -->$")
SHELLS = {"bash", "console"}
BLOCK_TIMEOUT = 900


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    not_run: str | None  # the reason, for a block marked not run

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[str]:
    found = ["README.md", *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").rglob("*.md")))]
    return [p for p in found if p not in GENERATED]


def blocks(page: str) -> list[Block]:
    lines = (ROOT / page).read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        start = i
        i += 1
        while i < len(lines) and lines[i].rstrip() != "```":
            i += 1
        before = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marked = NOT_RUN.match(before)
        out.append(Block(page, start + 1, opened.group(1), "\n".join(lines[start + 1: i]),
                         marked.group(1) if marked else None))
        i += 1
    return out


def runnable(page: str) -> list[Block]:
    return [b for b in blocks(page) if b.lang in SHELLS and b.not_run is None]


def buckets(page: str) -> set[str]:
    return {m.group(1) for b in runnable(page) for m in re.finditer(r"s3://([a-z0-9][a-z0-9.-]+)", b.text)}


def work_folder(path: Path) -> Path:
    """A folder holding links to the repository's files, as a checkout would: commands run from
    the repository root, and what they write stays in `path`. Not `examples/`: the commands that
    name an example config must work from any folder, as a user's who installed the project."""
    path.mkdir(parents=True, exist_ok=True)
    for entry in ROOT.iterdir():
        if (not entry.name.startswith(".") and entry.name not in {"README.md", "examples"}
                and not entry.name.endswith(".egg-info")):
            (path / entry.name).symlink_to(entry)
    return path


def _console(text: str) -> list[tuple[str, str]]:
    """(command, expected output) pairs of a console block."""
    pairs: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("$ "):
            pairs.append((line[2:], []))
        elif pairs:
            pairs[-1][1].append(line)
    return [(command, "\n".join(expected).strip() + "\n") for command, expected in pairs]


def run_block(block: Block, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str] | None:
    """Run one block; an AssertionError names the page and line, with the output's tail. A bash
    block's process is returned, for checks beyond its exit status. Its seconds are printed
    (`pytest -s` shows where a page's time goes)."""
    t0 = time.monotonic()
    try:
        return _run_block(block, cwd, env)
    finally:
        print(f"docs command: {block.where} took {time.monotonic() - t0:.1f} s")


def _run_block(block: Block, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str] | None:
    if block.lang == "bash":
        out = subprocess.run(["bash", "-euo", "pipefail", "-c", block.text], cwd=cwd, env=env, capture_output=True,
                             text=True, timeout=BLOCK_TIMEOUT)
        assert out.returncode == 0, (f"{block.where}: exit {out.returncode}\n{block.text}\n--- stdout\n"
                                     f"{out.stdout[-2000:]}\n--- stderr\n{out.stderr[-4000:]}")
        return out
    checker = doctest.OutputChecker()
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    for command, expected in _console(block.text):
        out = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, timeout=BLOCK_TIMEOUT)
        assert checker.check_output(expected, out.stdout, flags), (
            f"{block.where}: the output of `{command}` no longer matches the page\n--- documented\n{expected}"
            f"--- actual (exit {out.returncode})\n{out.stdout[-4000:]}")
    return None


def environment(prefect_api_url: str, s3_endpoint: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env.update({"PREFECT_API_URL": prefect_api_url, "AWS_ENDPOINT_URL": s3_endpoint,
                "RETRAIN_GIT_REPOSITORY": "", "RETRAIN_GIT_BRANCH": ""})
    return env
