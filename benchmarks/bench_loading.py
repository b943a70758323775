"""Loading: project loader (batches ready for the model) vs a numpy memmap vs WebDataset's
per-sample pipeline, on the same rows."""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import webdataset as wds

from benchmarks.common import demo_parquet
from training.config import load_config
from training.data.prepare.features import fit_feature_stats
from training.data.load.loader import ShardBatches, StreamPosition, make_train_loader
from training.data.ingest.packing import pack_local

BATCH = 256


def _rate(iterator, rows: int) -> float:
    t0 = time.perf_counter()
    seen = 0
    for batch in iterator:
        seen += len(batch[-1])
        if seen >= rows:
            break
    return seen / (time.perf_counter() - t0)


def _project_epochs(d: Path, manifest, transform, epochs: int, cache_bytes: int) -> list[float]:
    """Rows/s of each of `epochs` epochs, from a fresh loader in this process. The first pays
    the one-time sha256 check and the transform of every shard; later ones shuffle the shards
    kept in `cache_bytes` of memory again, and read and transform the others again."""
    batches = ShardBatches(d, manifest, "train", BATCH, transform, seed=0, cache_bytes=cache_bytes)
    it = iter(make_train_loader(batches, StreamPosition(), 0, pin_memory=False))
    next(it)  # start-up (first shard) is not throughput
    per_epoch = batches.batches_per_epoch
    rates = []
    for _ in range(epochs):
        t0 = time.perf_counter()
        for _ in range(per_epoch):
            next(it)
        rates.append(per_epoch * BATCH / (time.perf_counter() - t0))
    return rates


def run(work: Path, rows: int = 2_000_000, rounds: int = 3) -> dict[str, Any]:
    source = demo_parquet(work, rows)
    config = load_config()
    d, manifest, _ = pack_local(source, config.data, work / "datasets")
    _, stats = fit_feature_stats(d, manifest, config.preprocess, work / "pre")
    train_rows = manifest.rows["train"]
    out: dict[str, Any] = {"rows": train_rows, "train_shards": len(manifest.shards_of("train")), "batch": BATCH,
                           "rounds": rounds}

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

    # Rounds interleave the project loader and the reference, so drift on a shared box hits both.
    first, steady, uncached, memmap = [], [], [], []
    budget = int(load_config().train.loader.cache_mb * 1e6)
    for _ in range(rounds):
        rates = _project_epochs(d, manifest, stats.transformer(), 3, budget)
        first.append(rates[0])
        steady.append(statistics.median(rates[1:]))
        # A split larger than the loader's memory: every epoch reads and transforms every shard.
        uncached.append(statistics.median(_project_epochs(d, manifest, stats.transformer(), 3, 0)[1:]))
        memmap.append(_rate(memmap_batches(), train_rows))
    out["project_rows_per_s_workers_0_first_epoch"] = round(statistics.median(first))
    out["project_rows_per_s_workers_0"] = round(statistics.median(steady))
    out["memmap_rows_per_s"] = round(statistics.median(memmap))
    out["ratio_vs_memmap"] = round(statistics.median(s / m for s, m in zip(steady, memmap, strict=True)), 2)
    out["ratio_vs_memmap_first_epoch"] = round(statistics.median(f / m for f, m in zip(first, memmap, strict=True)), 2)
    out["project_rows_per_s_workers_0_nothing_kept"] = round(statistics.median(uncached))
    out["ratio_vs_memmap_nothing_kept"] = round(statistics.median(u / m for u, m in zip(uncached, memmap, strict=True)), 2)
    out["transformed_train_mb"] = round(sum(a.nbytes for a in all_rows.values()) / 1e6, 1)
    out["loader_cache_mb"] = budget / 1e6
    out["ratio_vs_memmap_per_round"] = [round(s / m, 2) for s, m in zip(steady, memmap, strict=True)]

    # DataLoader worker processes, handing over blocks of batches: their first epoch against the
    # in-process first epoch (each worker does the same reading and transform, plus a copy out
    # of the shard and the hand-off). `num_workers: auto` only picks them where they are faster.
    for workers in (1, 2):
        rates = []
        for _ in range(rounds):
            batches = ShardBatches(d, manifest, "train", BATCH, stats.transformer(), seed=0)
            it: Any = iter(make_train_loader(batches, StreamPosition(), workers, pin_memory=False))
            next(it)
            rates.append(_rate(((b[2]["num"], b[2]["cat"], b[2]["label"]) for b in it), train_rows - 2 * BATCH))
            it._shutdown_workers()  # DataLoader's worker iterator: no process outlives its round
        out[f"project_rows_per_s_workers_{workers}_first_epoch"] = round(statistics.median(rates))
        out[f"workers_{workers}_per_worker_vs_in_process_first_epoch"] = round(
            statistics.median(rates) / workers / out["project_rows_per_s_workers_0_first_epoch"], 2)

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

    # Against the project's slowest figure, its first epoch: WebDataset's pipeline keeps nothing.
    out["ratio_vs_webdataset"] = round(out["project_rows_per_s_workers_0_first_epoch"]
                                       / out["webdataset_per_sample_rows_per_s"], 1)
    return out
