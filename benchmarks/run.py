"""Run the benchmark suite: `python -m benchmarks.run [name ...]`.

Every figure is a ratio against a reference measured in the same run on the same bytes.
Writes benchmarks/results/<name>.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import logging
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.common import machine
from benchmarks.provenance import MEASURED, code_sha

# name -> module (benchmarks/bench_<name>.py, whose `run(work)` returns the figures). Imported
# only when asked for: `gpu` runs on a GPU machine that has the training core and none of the
# orchestration (Prefect, boto3, Lightning) the others import.
SUITE = ("packing", "loading", "peers", "checkpoint", "preemption", "warm_start", "overhead", "scale", "s3",
         "scaling", "transformer", "tuning", "tuning_replay", "predict", "lightning", "quality", "startup",
         "incremental", "pack_memory", "plan", "pack_plan", "gpu")


def _runner(name: str) -> Callable[[Path], dict[str, Any]]:
    return importlib.import_module(f"benchmarks.bench_{name}").run


META = ("machine", "command", "commit", "code_sha", "date", "load_before", "load_after", "wall_seconds")


def _commit(stem: str) -> str:
    """The commit measured, with "+changes" when the working tree differs from it in what the
    benchmark measures (its code_sha's files: another benchmark or a page being edited is not)."""
    repo = Path(__file__).resolve().parents[1]
    if os.environ.get("BENCH_COMMIT"):  # a copy of the tree (the GPU machine's) whose .git, if any, is not its own
        return os.environ["BENCH_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=repo, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *MEASURED,
                                f"benchmarks/bench_{stem}.py"], cwd=repo, capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("names", nargs="*", choices=[*SUITE, []], help="benchmarks to run (default: all)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    where = machine()
    # The GPU check runs where a GPU is; on a CPU machine only when named (its rehearsal).
    default = [n for n in SUITE if n != "gpu" or torch.cuda.is_available()]
    for name in args.names or default:
        with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as tmp:
            load_before = os.getloadavg()[0]
            t0 = time.perf_counter()
            result = _runner(name)(Path(tmp))
            # Where and when: the shared machines these run on are noisy, so the load is kept too.
            result["machine"] = where
            result["command"] = f"python -m benchmarks.run {name}"
            result["commit"] = _commit(name)
            result["code_sha"] = code_sha(name)  # docs/generate.py marks the result stale once it differs
            result["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
            result["load_before"] = round(load_before, 2)
            result["load_after"] = round(os.getloadavg()[0], 2)
            result["wall_seconds"] = round(time.perf_counter() - t0, 1)
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
        print(f"\n### {name}  ({where})")
        print("| figure | value |\n|---|---|")
        for key, value in result.items():
            if key not in META:
                print(f"| {key} | {str(value)[:200]} |")


if __name__ == "__main__":
    main()
