"""Scale: packing and loading throughput per row, and peak memory, at three dataset sizes.

Each measurement runs in a fresh subprocess so its peak RSS is its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

SIZES = (100_000, 1_000_000, 5_000_000)

_CHILD = r"""
import json, resource, sys, time
from pathlib import Path
from training.config import load_config
from training.data.ingest.demo import ensure_demo_dataset
work, rows, what = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
def hwm():
    # This process's peak RSS in KiB. Not getrusage's ru_maxrss: that survives exec, so a child
    # of a large parent would report the parent's peak.
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
config = load_config()
source = work / "demo" / f"shop-{rows}-1.parquet"
if what == "generate":
    ensure_demo_dataset(work, rows=rows, seed=1)
    print(json.dumps({}))
    sys.exit()
from training.data.ingest.packing import pack_local
base = hwm()
t0 = time.perf_counter()
d, manifest, _ = pack_local(source, config.data, work / "datasets")
if what == "pack":
    seconds = time.perf_counter() - t0
else:
    from training.data.prepare.features import fit_feature_stats
    from training.data.load.loader import ShardBatches, StreamPosition, make_train_loader
    _, stats = fit_feature_stats(d, manifest, config.preprocess, work / "pre")
    base = hwm()
    budget = int(config.train.loader.cache_mb * 1e6) if what == "load" else 0
    batches = ShardBatches(d, manifest, "train", 512, stats.transformer(), seed=0, cache_bytes=budget)
    t0 = time.perf_counter()
    seen = 0
    for _, _, batch in make_train_loader(batches, StreamPosition(), 0, False):
        seen += len(batch["label"])
        if seen >= manifest.rows["train"]:
            break
    seconds = time.perf_counter() - t0
peak = hwm()
print(json.dumps({"rows_per_s": rows / seconds if what == "pack" else seen / seconds,
                  "peak_rss_mb": peak / 1024, "rss_growth_mb": (peak - base) / 1024}))
"""


def _child(work: Path, rows: int, what: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(work), str(rows), what], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parent.parent)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(work: Path) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for rows in SIZES:
        size_dir = work / str(rows)
        _child(size_dir, rows, "generate")
        pack = _child(size_dir, rows, "pack")  # fresh packing: no dataset yet
        load = _child(size_dir, rows, "load")  # reuses the packed dataset, reads one epoch
        # The same with train.loader.cache_mb: 0, as for a split larger than that budget.
        load0 = _child(size_dir, rows, "load-nothing-kept")
        result[f"rows_{rows}"] = {
            "pack_rows_per_s": round(pack["rows_per_s"]), "pack_peak_rss_mb": round(pack["peak_rss_mb"]),
            "pack_rss_growth_mb": round(pack["rss_growth_mb"]),
            "load_rows_per_s": round(load["rows_per_s"]), "load_peak_rss_mb": round(load["peak_rss_mb"]),
            "load_rss_growth_mb": round(load["rss_growth_mb"]),
            "load_nothing_kept_rows_per_s": round(load0["rows_per_s"]),
            "load_nothing_kept_peak_rss_mb": round(load0["peak_rss_mb"]),
            "load_nothing_kept_rss_growth_mb": round(load0["rss_growth_mb"]),
        }
    return result
