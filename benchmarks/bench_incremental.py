"""Incremental retraining: 30 daily files, then a 31st, then a 32nd from the same distribution.

The runs are the flow's stages in this process (pack, decide, preprocess, train, evaluate), so
each is timed without Prefect's fixed start-up, on both sides of every ratio:

- day 31's run: bytes read from the source against the new file's size; bytes written under
  datasets/ against its share of the dataset; on moto's S3 server (in this process, on
  127.0.0.1), bytes PUT against the new segment's files;
- day 31's run warm-started from the champion (train.init_from: champion) against a run from
  scratch on all 31 days (a fresh root: packing everything, training train.max_steps): wall
  time and test AUC, over interleaved rounds (each warm run on its own copy of the root as the
  30 days left it), the ratio being the median of the per-round ratios;
- train.retrain_when: drift on no new data, and on a 32nd day like the others: wall time against
  that run from scratch;
- re-verification: the pack stage's seconds on the runs with nothing new (the 2nd, 3rd, ... run
  on the same data), and how many shards' size and mtime no longer match their verification
  record after each run (each such shard is hashed again on the next run);
- a source of 2,000 files of 10 rows: the first pack, and the pack of reruns with nothing new,
  which should cost about a listing and a stat per file.
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from training.config import RetrainConfig, load_config
from training.data.ingest.demo import ensure_demo_dataset

DAYS, DAY_ROWS = 30, 200_000


def _daily_files(work: Path, days: int, rows: int) -> list[Path]:
    """`days` daily files cut from one draw of the demo generator: one distribution, one label model."""
    full, _ = ensure_demo_dataset(work / "gen", rows=days * rows, seed=31)
    table = pq.read_table(full)
    out = work / "days"
    out.mkdir()
    paths = []
    for d in range(days):
        path = out / f"day-{d:02d}.parquet"
        pq.write_table(table.slice(d * rows, rows), path, row_group_size=rows)
        paths.append(path)
    full.unlink()
    return paths


def _pipeline(config: RetrainConfig) -> dict[str, Any]:
    """The retrain flow's stages, as the flow runs them; the wall time and what each returned."""
    from training.pipeline.decide_stage import decide_stage
    from training.pipeline.evaluate_stage import evaluate_stage
    from training.pipeline.pack_stage import pack_stage
    from training.pipeline.preprocess_stage import preprocess_stage
    from training.pipeline.train_stage import train_stage
    from training.registry.champion import champion_of

    marks = [time.perf_counter()]
    packed = pack_stage(config)
    marks.append(time.perf_counter())
    decision = decide_stage(config, packed)
    marks.append(time.perf_counter())
    out: dict[str, Any] = {"packed": packed, "decision": decision}
    if decision.train:
        prep = preprocess_stage(packed.dataset_dir, config.preprocess, config.storage)
        marks.append(time.perf_counter())
        trained = train_stage(config, packed, prep, champion_of(config))
        marks.append(time.perf_counter())
        out.update(trained=trained, evaluation=evaluate_stage(config, packed, trained))
        marks.append(time.perf_counter())
    out["seconds"] = marks[-1] - marks[0]
    names = ("pack", "decide", "preprocess", "train", "evaluate")
    out["stages"] = {name: round(b - a, 2) for name, a, b in zip(names, marks, marks[1:], strict=False)}
    return out


def _stale_stamps(root: Path) -> tuple[int, int]:
    """(shards whose size or mtime differs from their verification record, shards in all) under
    a root's segments: each stale one is hashed again by the next run's pack stage."""
    import json

    stale = total = 0
    for folder in (root / "datasets" / "segments").iterdir():
        if not folder.is_dir():
            continue
        record_path = folder.with_name(f".{folder.name}.verified.json")
        record = json.loads(record_path.read_text()) if record_path.exists() else {}
        for shard in folder.glob("*.tar"):
            st = shard.stat()
            total += 1
            stale += record.get(shard.name) != [st.st_size, st.st_mtime_ns]
    return stale, total


def _many_files(work: Path, files: int = 2000, rows: int = 10, rounds: int = 3) -> dict[str, Any]:
    """A source of many small files: the first pack, then reruns with nothing new."""
    from training.pipeline.pack_stage import pack_stage

    full, _ = ensure_demo_dataset(work / "many-gen", rows=files * rows, seed=7)
    table = pq.read_table(full)
    source = work / "many-src"
    source.mkdir()
    for i in range(files):
        pq.write_table(table.slice(i * rows, rows), source / f"part-{i:05d}.parquet")
    config = _config(work / "many-root", source)
    start = time.perf_counter()
    first = pack_stage(config)
    first_seconds = time.perf_counter() - start
    again = []
    for _ in range(rounds):
        start = time.perf_counter()
        rerun = pack_stage(config)
        again.append(time.perf_counter() - start)
        assert rerun.segments_packed == 0 and rerun.fingerprint == first.fingerprint
    return {"many_files": files, "many_rows_per_file": rows, "many_first_pack_seconds": round(first_seconds, 2),
            "many_nothing_new_pack_seconds": [round(s, 2) for s in again],
            "many_nothing_new_ms_per_file": round(1000 * statistics.median(again) / files, 3)}


def _du(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _config(root: Path, source: Path, *extra: str) -> RetrainConfig:
    # eval.min_delta: the champion's AUC on 200k new rows wanders by about 0.002 around its test
    # AUC with no change at all; a drop past 0.005 counts as degraded.
    return load_config(overrides=[f"storage.root={root}", f"data.source={source}", "eval.min_delta=0.005",
                                  *extra])


def _s3_bytes_put(work: Path, files: list[Path], days: int) -> dict[str, Any]:
    """Packing onto an s3:// root on moto's server: what day 31 uploads."""
    import boto3
    from moto.server import ThreadedMotoServer

    from training.pipeline.pack_stage import pack_stage

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "benchmark")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "benchmark")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's server logs every request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{server.get_host_and_port()[1]}"
        raw = boto3.client("s3", endpoint_url=endpoint)
        raw.create_bucket(Bucket="bench")
        source = work / "s3-src"
        source.mkdir()
        for path in files[:days]:
            os.link(path, source / path.name)
        config = load_config(overrides=[f"data.source={source}", "storage.root=s3://bench/root",
                                        f"storage.endpoint_url={endpoint}", f"storage.local_dir={work / 's3-local'}"])
        pack_stage(config)

        def objects() -> dict[str, int]:
            pages = raw.get_paginator("list_objects_v2").paginate(Bucket="bench", Prefix="root/datasets/")
            return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}

        before = objects()
        os.link(files[days], source / files[days].name)
        grown = pack_stage(config)
        after = objects()
        put = sum(size for key, size in after.items() if before.get(key) != size)
        segment = [k for k in after if k not in before and k.endswith("/segment.json")]
        segment_files = sum(size for key, size in after.items() if segment and key.startswith(segment[0][:-12]))
        return {"s3_bytes_put": put, "s3_new_segment_bytes": segment_files,
                "s3_put_over_new_segment": round(put / segment_files, 3),
                "s3_uploaded_bytes_reported": grown.uploaded_bytes}
    finally:
        server.stop()


def run(work: Path, days: int = DAYS, day_rows: int = DAY_ROWS, rounds: int = 3) -> dict[str, Any]:
    files = _daily_files(work, days + 2, day_rows)
    source = work / "src"
    source.mkdir()
    for path in files[:days]:
        os.link(path, source / path.name)
    root = work / "root"
    champion = _pipeline(_config(root, source))
    stale = [_stale_stamps(root)[0]]

    os.link(files[days], source / files[days].name)  # day 31 arrives
    before_31 = work / "root-before-day-31"
    shutil.copytree(root, before_31)  # each later round's warm run starts from a copy of it
    written_before = _du(root / "datasets")
    warm = _pipeline(_config(root, source, "train.init_from=champion"))
    written = _du(root / "datasets") - written_before
    scratch = _pipeline(_config(work / "scratch-root", source))  # everything, from nothing
    share = sum(s.bytes for s in _shards(scratch)) / (days + 1)
    warm_rounds, scratch_rounds = [warm["seconds"]], [scratch["seconds"]]
    for r in range(1, rounds):  # interleaved, so that drift on a shared machine hits both sides
        copy = work / f"warm-root-{r}"
        shutil.copytree(before_31, copy)
        warm_rounds.append(_pipeline(_config(copy, source, "train.init_from=champion"))["seconds"])
        shutil.rmtree(copy)
        fresh = work / f"scratch-root-{r}"
        scratch_rounds.append(_pipeline(_config(fresh, source))["seconds"])
        shutil.rmtree(fresh)
    warm_ratios = [round(w / s, 3) for w, s in zip(warm_rounds, scratch_rounds, strict=True)]

    stale.append(_stale_stamps(root)[0])
    same_runs = []
    for _ in range(rounds):
        same_runs.append(_pipeline(_config(root, source, "train.retrain_when=drift")))
        stale.append(_stale_stamps(root)[0])
    same = [r["seconds"] for r in same_runs]
    os.link(files[days + 1], source / files[days + 1].name)  # day 32, like the others
    calm = [_pipeline(_config(root, source, "train.retrain_when=drift")) for _ in range(rounds)]
    full = scratch["seconds"]
    packed = warm["packed"]
    return {
        "days": days, "rows_per_day": day_rows, "rounds_of_skipped_runs": rounds,
        "day31_source_bytes_read": packed.source_bytes_read, "day31_file_bytes": files[days].stat().st_size,
        "day31_read_over_file": round(packed.source_bytes_read / files[days].stat().st_size, 3),
        "day31_bytes_written_under_datasets": written, "day31_share_of_dataset_bytes": round(share),
        "day31_written_over_share": round(written / share, 3),
        **_s3_bytes_put(work, files, days),
        "champion_run_seconds": round(champion["seconds"], 1),
        "warm_day31_seconds": round(warm["seconds"], 1), "scratch_31_days_seconds": round(full, 1),
        "warm_day31_seconds_per_round": [round(s, 1) for s in warm_rounds],
        "scratch_31_days_seconds_per_round": [round(s, 1) for s in scratch_rounds],
        "warm_over_scratch_seconds_per_round": warm_ratios,
        "warm_over_scratch_seconds": statistics.median(warm_ratios),
        "warm_stage_seconds": warm["stages"], "scratch_stage_seconds": scratch["stages"],
        "warm_train_seconds": _train_seconds(warm), "scratch_train_seconds": _train_seconds(scratch),
        "warm_steps": warm["trained"].steps, "scratch_steps": scratch["trained"].steps,
        "warm_test_auc": round(warm["evaluation"].metrics["auc"], 4),
        "scratch_test_auc": round(scratch["evaluation"].metrics["auc"], 4),
        "warm_minus_scratch_test_auc": round(warm["evaluation"].metrics["auc"] - scratch["evaluation"].metrics["auc"], 4),
        "no_new_data_seconds": [round(s, 2) for s in same],
        "no_new_data_pack_seconds": [r["stages"]["pack"] for r in same_runs],
        "shards": _stale_stamps(root)[1],
        "stale_verification_stamps_after_each_run": stale,
        "no_new_data_over_scratch": round(statistics.median(same) / full, 4),
        "no_drift_day32_seconds": [round(c["seconds"], 2) for c in calm],
        "no_drift_day32_over_scratch": round(statistics.median(c["seconds"] for c in calm) / full, 4),
        "no_drift_day32_trained": [c["decision"].train for c in calm],
        "no_drift_day32_reason": calm[0]["decision"].reason,
        "no_drift_day32_max_psi": round(max(calm[0]["decision"].drift.values(), default=0.0), 4),
        **_many_files(work),
    }


def _train_seconds(result: dict[str, Any]) -> dict[str, float]:
    """Where the training stage's time went: the process's start-up, steps, validations, checkpoints."""
    seconds = result["trained"].seconds
    return {k: round(getattr(seconds, k), 2) for k in ("startup", "train", "eval", "checkpoint")}


def _shards(result: dict[str, Any]) -> list[Any]:
    from training.data.manifest import require_manifest

    return require_manifest(Path(result["packed"].dataset_dir)).shards
