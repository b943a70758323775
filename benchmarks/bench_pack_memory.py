"""Packing memory does not grow with the data: the pack and preprocess stages' peak memory at
20M and at 60M rows (100 and 300 files of 200k rows), each in a fresh process.

The files are 20 distinct draws of the demo generator, linked over and over under other names:
every name is a file of its own to the packer (its own segment), and generating 60M distinct
rows would take longer than packing them. Peak RSS is the kernel's high-water mark (VmHWM);
peak anonymous memory is RssAnon sampled every 20 ms.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from training.data.ingest.demo import ensure_demo_dataset

FILE_ROWS = 200_000
DRAWS = 20
SIZES = (20_000_000, 60_000_000)

_CHILD = r"""
import json, sys, threading, time
from pathlib import Path
from training.config import load_config
from training.pipeline.pack_stage import pack_stage
from training.pipeline.preprocess_stage import preprocess_stage
source, root = sys.argv[1], sys.argv[2]

def status(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0

peak_anon = {"pack": 0, "preprocess": 0}
stage = ["pack"]
done = threading.Event()
def sample():
    while not done.is_set():
        peak_anon[stage[0]] = max(peak_anon[stage[0]], status("RssAnon"))
        time.sleep(0.02)
threading.Thread(target=sample, daemon=True).start()
base_rss, base_anon = status("VmRSS"), status("RssAnon")
config = load_config(overrides=[f"storage.root={root}", f"data.source={source}"])
t0 = time.perf_counter()
packed = pack_stage(config)
t1 = time.perf_counter()
pack_rss = status("VmHWM")
stage[0] = "preprocess"
preprocess_stage(packed.dataset_dir, config.preprocess, config.storage)
t2 = time.perf_counter()
done.set()
print(json.dumps({"rows": sum(packed.rows.values()), "segments": packed.segments, "pack_seconds": t1 - t0,
                  "preprocess_seconds": t2 - t1, "peak_rss": status("VmHWM"), "pack_peak_rss": pack_rss,
                  "peak_anon": max(peak_anon.values()), "pack_peak_anon": peak_anon["pack"],
                  "preprocess_peak_anon": peak_anon["preprocess"],
                  "base_rss": base_rss, "base_anon": base_anon}))
"""


def _draws(work: Path) -> list[Path]:
    return [ensure_demo_dataset(work / f"draw-{i}", rows=FILE_ROWS, seed=100 + i)[0] for i in range(DRAWS)]


def _measure(work: Path, draws: list[Path], rows: int) -> dict[str, Any]:
    source = work / f"src-{rows}"
    source.mkdir()
    for i in range(rows // FILE_ROWS):
        os.link(draws[i % DRAWS], source / f"part-{i:04d}.parquet")
    out = subprocess.run([sys.executable, "-c", _CHILD, str(source), str(work / f"root-{rows}")], capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parents[1])
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(work: Path) -> dict[str, Any]:
    draws = _draws(work)
    small, large = (_measure(work, draws, rows) for rows in SIZES)
    mb = 1 << 20
    return {
        "rows": [small["rows"], large["rows"]],
        "files": [s // FILE_ROWS for s in SIZES],
        "peak_rss_mb": [round(small["peak_rss"] / mb), round(large["peak_rss"] / mb)],
        "peak_anon_mb": [round(small["peak_anon"] / mb), round(large["peak_anon"] / mb)],
        "rss_at_start_mb": [round(small["base_rss"] / mb), round(large["base_rss"] / mb)],
        "pack_peak_rss_mb": [round(small["pack_peak_rss"] / mb), round(large["pack_peak_rss"] / mb)],
        "pack_peak_anon_mb": [round(small["pack_peak_anon"] / mb), round(large["pack_peak_anon"] / mb)],
        "preprocess_peak_anon_mb": [round(small["preprocess_peak_anon"] / mb),
                                    round(large["preprocess_peak_anon"] / mb)],
        "peak_rss_60m_over_20m": round(large["peak_rss"] / small["peak_rss"], 3),
        "peak_anon_60m_over_20m": round(large["peak_anon"] / small["peak_anon"], 3),
        "pack_seconds": [round(small["pack_seconds"], 1), round(large["pack_seconds"], 1)],
        "preprocess_seconds": [round(small["preprocess_seconds"], 2), round(large["preprocess_seconds"], 2)],
        "pack_rows_per_second": [round(small["rows"] / small["pack_seconds"]),
                                 round(large["rows"] / large["pack_seconds"])],
    }
