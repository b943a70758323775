"""Run the benchmark suite: `python -m benchmarks.run [name ...]`.

Every figure is a ratio against a reference measured in the same run on the same bytes.
Writes benchmarks/results/<name>.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks import (
    bench_checkpoint,
    bench_incremental,
    bench_lightning,
    bench_loading,
    bench_overhead,
    bench_pack_memory,
    bench_packing,
    bench_peers,
    bench_plan,
    bench_predict,
    bench_quality,
    bench_preemption,
    bench_s3,
    bench_scaling,
    bench_scale,
    bench_startup,
    bench_transformer,
    bench_tuning,
    bench_tuning_replay,
    bench_warm_start,
)
from benchmarks.common import machine

SUITE = {
    "packing": bench_packing.run,
    "loading": bench_loading.run,
    "peers": bench_peers.run,
    "checkpoint": bench_checkpoint.run,
    "preemption": bench_preemption.run,
    "warm_start": bench_warm_start.run,
    "overhead": bench_overhead.run,
    "scale": bench_scale.run,
    "s3": bench_s3.run,
    "scaling": bench_scaling.run,
    "transformer": bench_transformer.run,
    "tuning": bench_tuning.run,
    "tuning_replay": bench_tuning_replay.run,
    "predict": bench_predict.run,
    "lightning": bench_lightning.run,
    "quality": bench_quality.run,
    "startup": bench_startup.run,
    "incremental": bench_incremental.run,
    "pack_memory": bench_pack_memory.run,
    "plan": bench_plan.run,
}


META = ("machine", "command", "commit", "date", "load_before", "load_after", "wall_seconds")


def _commit() -> str:
    """The commit measured, with "+changes" when the working tree differs from it."""
    repo = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=repo, capture_output=True, text=True,
                              check=True).stdout.strip()
        # Results the suite itself wrote are not changes to what it measured.
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":!benchmarks/results"], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
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
    for name in args.names or list(SUITE):
        with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as tmp:
            load_before = os.getloadavg()[0]
            t0 = time.perf_counter()
            result = SUITE[name](Path(tmp))
            # Where and when: the shared machines these run on are noisy, so the load is kept too.
            result["machine"] = where
            result["command"] = f"python -m benchmarks.run {name}"
            result["commit"] = _commit()
            result["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
            result["load_before"] = round(load_before, 2)
            result["load_after"] = round(os.getloadavg()[0], 2)
            result["wall_seconds"] = round(time.perf_counter() - t0, 1)
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
        print(f"\n### {name}  ({where})")
        print("| figure | value |\n|---|---|")
        for key, value in result.items():
            if key not in META:
                print(f"| {key} | {value} |")


if __name__ == "__main__":
    main()
