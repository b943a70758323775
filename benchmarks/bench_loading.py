"""Loading: project loader (batches ready for the model) vs a numpy memmap vs WebDataset's
per-sample pipeline, on the same rows."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import webdataset as wds

from benchmarks.common import demo_parquet
from training.config import load_config
from training.data.features import fit_feature_stats
from training.data.loader import ShardBatches, StreamPosition, make_train_loader
from training.data.packing import pack_shards

BATCH = 256


def _rate(iterator, rows: int) -> float:
    t0 = time.perf_counter()
    seen = 0
    for batch in iterator:
        seen += len(batch[-1])
        if seen >= rows:
            break
    return seen / (time.perf_counter() - t0)


def run(work: Path, rows: int = 500_000) -> dict[str, Any]:
    source = demo_parquet(work, rows)
    config = load_config()
    d, manifest, _ = pack_shards(source, config.data, work / "datasets")
    _, stats = fit_feature_stats(d, manifest, config.preprocess, work / "pre")
    train_rows = manifest.rows["train"]
    out: dict[str, Any] = {"rows": train_rows, "batch": BATCH}

    for workers in (0, 2):
        batches = ShardBatches(d, manifest, "train", BATCH, stats.transformer(), seed=0)
        loader = make_train_loader(batches, StreamPosition(), workers, pin_memory=False)
        it = iter(loader)
        next(it)  # start-up (worker spawn, first shard verify) is not throughput
        rate = _rate(((b[2], b[3], b[4]) for b in it), train_rows)
        getattr(it, "_shutdown_workers", lambda: None)()
        out[f"project_rows_per_s_workers_{workers}"] = round(rate)

    # Reference 1: the same arrays as a numpy memmap, read sequentially in batches of 256.
    batches = ShardBatches(d, manifest, "train", BATCH, stats.transformer(), shuffle=False)
    all_rows = {k: np.concatenate([batches._shard_arrays(i)[k] for i in range(len(batches.shards))])
                for k in ("num", "cat", "label")}
    mm = {}
    for k, v in all_rows.items():
        path = work / f"{k}.npy"
        np.save(path, v)
        mm[k] = np.load(path, mmap_mode="r")

    def memmap_batches():
        for lo in range(0, train_rows - BATCH + 1, BATCH):
            yield (torch.from_numpy(np.array(mm["num"][lo:lo + BATCH])), torch.from_numpy(np.array(mm["cat"][lo:lo + BATCH])),
                   torch.from_numpy(np.array(mm["label"][lo:lo + BATCH])))

    out["memmap_rows_per_s"] = round(_rate(memmap_batches(), train_rows))

    # Reference 2: WebDataset's default per-sample pipeline over one-row-per-member shards.
    wds_dir = work / "wds-rows"
    shutil.rmtree(wds_dir, ignore_errors=True)
    wds_dir.mkdir()
    sub = 40_000
    with wds.ShardWriter(str(wds_dir / "shard-%06d.tar"), maxsize=16_000_000, verbose=0) as sink:
        for i in range(sub):
            sink.write({"__key__": f"{i:09d}", "num.npy": all_rows["num"][i], "cat.npy": all_rows["cat"][i],
                        "label.npy": all_rows["label"][i:i + 1]})
    urls = sorted(str(p) for p in wds_dir.glob("*.tar"))
    pipeline = wds.WebDataset(urls, shardshuffle=False).decode().to_tuple("num.npy", "cat.npy", "label.npy").batched(BATCH)
    out["webdataset_per_sample_rows_per_s"] = round(_rate(((n, c, lab.reshape(-1)) for n, c, lab in pipeline), sub - BATCH))

    best = max(out["project_rows_per_s_workers_0"], out["project_rows_per_s_workers_2"])
    out["ratio_vs_memmap"] = round(best / out["memmap_rows_per_s"], 2)
    out["ratio_vs_webdataset"] = round(best / out["webdataset_per_sample_rows_per_s"], 1)
    return out
