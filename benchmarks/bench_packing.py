"""Packing throughput: project packer vs the raw limit vs webdataset.ShardWriter (one row per member)."""

from __future__ import annotations

import shutil
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import webdataset as wds

from benchmarks.common import best_of, demo_parquet
from training.config import load_config
from training.data.ingest.validation import category_hash
from training.data.ingest.packing import pack_local


def run(work: Path, rows: int = 500_000, rounds: int = 5) -> dict[str, Any]:
    source = demo_parquet(work, rows)
    config = load_config()
    n_num, n_cat = len(config.data.numeric), len(config.data.categorical)
    payload = rows * (4 * n_num + 8 * n_cat + 4)

    # Each packer on a storage root of its own, emptied before every timed run: packed segments
    # are kept under the root and found again, so a second run into the same root packs nothing.
    def project() -> None:
        shutil.rmtree(work / "single", ignore_errors=True)
        pack_local(source, config.data, work / "single" / "datasets")

    grouped = work / "grouped.parquet"  # the same rows in 4 row groups: 4 segments of the flow's fan-out
    pq.write_table(pq.read_table(source), grouped, row_group_size=-(-rows // 4))
    segmented = config.data.model_copy(update={"segment_rows": -(-rows // 4)})

    def project_parts() -> None:
        # The flow's fan-out path, run in this process: plan, 4 segments packed one by one, assemble.
        shutil.rmtree(work / "parts", ignore_errors=True)
        pack_local(grouped, segmented, work / "parts" / "datasets")

    def raw_limit() -> None:
        # pyarrow reads the same Parquet and the same payload bytes go to one file.
        table = pq.read_table(source)
        with open(work / "raw.bin", "wb") as f:
            f.write(np.stack([table[c].to_numpy().astype(np.float32) for c in config.data.numeric], 1).tobytes())
            f.write(np.stack([category_hash(table[c]) for c in config.data.categorical], 1).tobytes())
            f.write(table[config.data.label].to_numpy().astype(np.float32).tobytes())

    sub = min(rows, 50_000)  # ShardWriter is slow: time a slice and scale per MB

    def shardwriter() -> None:
        table = pq.read_table(source).slice(0, sub)
        num = np.stack([table[c].to_numpy().astype(np.float32) for c in config.data.numeric], 1)
        cat = np.stack([category_hash(table[c]) for c in config.data.categorical], 1)
        label = table[config.data.label].to_numpy().astype(np.float32)
        out = work / "wds"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        with wds.ShardWriter(str(out / "shard-%06d.tar"), maxsize=16_000_000, verbose=0) as sink:
            for i in range(sub):
                sink.write({"__key__": f"{i:09d}", "num.npy": num[i], "cat.npy": cat[i], "label.npy": label[i:i + 1]})

    # Rounds interleave the packer and the raw limit, so drift on a shared box hits both; the
    # ratio is the median over rounds of the ratio within a round.
    t_projects, t_raws = [], []
    for _ in range(rounds):
        t_projects.append(best_of(project, repeat=1))
        t_raws.append(best_of(raw_limit, repeat=1))
    t_project, t_raw = statistics.median(t_projects), statistics.median(t_raws)
    ratios = [r / p for r, p in zip(t_raws, t_projects, strict=True)]
    t_parts = best_of(project_parts)
    t_wds = best_of(shardwriter, repeat=1)
    mb = payload / 1e6
    wds_mb = mb * sub / rows
    project_bytes = sum(p.stat().st_size for p in (work / "single").rglob("*.tar"))
    wds_bytes = sum(p.stat().st_size for p in (work / "wds").glob("*.tar"))
    from training.data.manifest import require_manifest

    manifest = require_manifest(next(p.parent for p in (work / "single" / "datasets").glob("*/manifest.json")))
    target = config.data.shard_size_mb * 1e6
    full = [sh.bytes for split in ("train", "validation", "test") for sh in manifest.shards_of(split)[:-1]]
    return {
        "rows": rows,
        "rounds": rounds,
        "project_parts_path_mb_per_s": round(payload / 1e6 / t_parts, 1),
        "shards_below_last_per_split": len(full),
        "max_shard_size_deviation_from_target": round(max((abs(b - target) / target for b in full), default=0.0), 4),
        "payload_mb": round(mb, 2),
        "project_mb_per_s": round(mb / t_project, 1),
        "raw_limit_mb_per_s": round(mb / t_raw, 1),
        "shardwriter_mb_per_s": round(wds_mb / t_wds, 1),
        "ratio_vs_raw_limit": round(statistics.median(ratios), 2),
        "ratio_vs_raw_limit_per_round": [round(x, 2) for x in ratios],
        "ratio_vs_shardwriter": round((mb / t_project) / (wds_mb / t_wds), 1),
        "bytes_on_disk_per_payload_byte": {"project": round(project_bytes / payload, 3),
                                           "shardwriter": round(wds_bytes / (payload * sub / rows), 3)},
    }
