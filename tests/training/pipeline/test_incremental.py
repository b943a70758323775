"""Incremental retraining: a dataset made of segments, so a run on data that grew packs, reads,
uploads and fits what is new, rows keep their split, windows and retention choose what is kept,
and a run with nothing to learn keeps the champion."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tests.conftest import s3_overrides, small_overrides
from training.config import RetrainConfig, load_config
from training.data.prepare.features import FeatureStats, dataset_stats
from training.data.load.loader import ShardBatches, iter_split
from training.data.manifest import require_manifest, shard_folder
from training.data.shards import ShardReader
from training.pipeline.pack_stage import pack_stage


def _days(demo_source: Path, folder: Path, days: int, with_id: bool = True) -> list[Path]:
    """The demo rows cut into `days` daily files, each row with a unique id and its day."""
    table = pq.read_table(demo_source)
    if with_id:
        table = table.append_column("id", pa.array(np.arange(table.num_rows)))
    folder.mkdir(parents=True, exist_ok=True)
    per = table.num_rows // days
    paths = []
    for d in range(days):
        part = table.slice(d * per, per)
        stamp = pa.array(np.full(part.num_rows, 1_700_000_000 + d * 86_400), pa.int64()).cast(pa.timestamp("s"))
        path = folder / f"day-{d:02d}.parquet"
        pq.write_table(part.append_column("ts", stamp), path)
        paths.append(path)
    return paths


def _config(root: Path, source: Path, *extra: str) -> RetrainConfig:
    return load_config(overrides=[*small_overrides(root, source), *extra])


def _ids_by_split(dataset_dir: Path, config: RetrainConfig) -> dict[str, set[int]]:
    """Which `id` values each split holds (the id column packed as a numeric feature)."""
    manifest = require_manifest(dataset_dir)
    j = config.data.numeric.index("id")
    out: dict[str, set[int]] = {}
    for shard in manifest.shards:
        reader = ShardReader(shard_folder(dataset_dir, shard) / shard.name)
        ids = {int(v) for key in reader.keys for v in reader.block(key).num[:, j]}
        reader.close()
        out.setdefault(shard.split, set()).update(ids)
    return out


def test_a_new_file_packs_reads_and_fits_only_that_file(tmp_path: Path, demo_source: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    days = _days(demo_source, tmp_path / "all", 4)
    for path in days[:3]:
        os.link(path, source / path.name)
    config = _config(tmp_path / "root", source)
    first = pack_stage(config)
    assert first.segments == 3 and first.segments_packed == 3
    segments = tmp_path / "root" / "datasets" / "segments"
    before = {p: p.stat().st_mtime_ns for p in segments.rglob("*.tar")}

    os.link(days[3], source / days[3].name)
    grown = pack_stage(config)
    assert grown.fingerprint != first.fingerprint and grown.segments == 4 and grown.segments_packed == 1
    new_file = days[3].stat().st_size
    assert grown.source_bytes_read <= 1.2 * new_file  # the old files: not a byte
    assert grown.packed_bytes <= 1.2 * (first.packed_bytes / 3)
    assert {p: p.stat().st_mtime_ns for p in before} == before  # old segments untouched
    old = require_manifest(Path(first.dataset_dir))
    new = require_manifest(Path(grown.dataset_dir))
    assert [s.key for s in new.segments[:3]] == [s.key for s in old.segments]

    again = pack_stage(config)
    assert again.reused and again.source_bytes_read == 0 and again.fingerprint == grown.fingerprint


def test_rows_keep_their_split_as_files_are_added(tmp_path: Path, demo_source: Path) -> None:
    days = _days(demo_source, tmp_path / "src", 4)
    config = _config(tmp_path / "root", tmp_path / "src", "data.numeric=[price, id]")
    grown = _ids_by_split(Path(pack_stage(config).dataset_dir), config)
    for path in days[2:]:
        path.rename(tmp_path / path.name)
    fewer = _ids_by_split(Path(pack_stage(config).dataset_dir), config)
    for split, ids in fewer.items():
        assert ids <= grown[split]  # every row of the first two days kept its split
    assert sum(len(v) for v in fewer.values()) == 4000


def test_a_split_key_puts_every_row_of_a_key_in_one_split(tmp_path: Path, demo_source: Path) -> None:
    _days(demo_source, tmp_path / "src", 2)
    config = _config(tmp_path / "root", tmp_path / "src", "data.split_key=region", "data.numeric=[price, id]")
    packed = pack_stage(config)
    table = pa.concat_tables([pq.read_table(p) for p in sorted((tmp_path / "src").iterdir())])
    ids = _ids_by_split(Path(packed.dataset_dir), config)
    region_of = dict(zip(table.column("id").to_pylist(), table.column("region").to_pylist(), strict=True))
    regions = {split: {region_of[i] for i in found} for split, found in ids.items()}
    assert not regions["train"] & regions["test"] and not regions["train"] & regions["validation"]
    assert all(regions.values())


def test_merged_statistics_are_those_of_all_train_rows(tmp_path: Path, demo_source: Path) -> None:
    _days(demo_source, tmp_path / "src", 4)
    config = _config(tmp_path / "root", tmp_path / "src")
    packed = pack_stage(config)
    manifest = require_manifest(Path(packed.dataset_dir))
    merged = dataset_stats(Path(packed.dataset_dir), manifest)
    identity = FeatureStats(manifest.numeric, manifest.categorical, [0.0] * 6, [1.0] * 6, [[] for _ in range(4)])
    batches = ShardBatches(Path(packed.dataset_dir), manifest, "train", 1024, identity.transformer(), shuffle=False,
                           drop_last=False)
    rows = list(iter_split(batches))
    num = np.concatenate([b["num"].numpy() for b in rows]).astype(np.float64)
    assert merged.rows == len(num) == manifest.rows["train"]
    np.testing.assert_allclose(merged.numeric.mean, num.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(merged.numeric.std, num.std(axis=0), rtol=1e-10)
    np.testing.assert_allclose(merged.numeric.minimum, num.min(axis=0))

    from training.data.ingest.validation import category_hash

    table = pa.concat_tables([pq.read_table(p) for p in sorted((tmp_path / "src").iterdir())])
    from training.data.ingest.segments import split_of_file

    train = np.concatenate([split_of_file(p, config.data) for p in sorted((tmp_path / "src").iterdir())]) == 0
    j = manifest.categorical.index("brand")
    hashes, counts = np.unique(category_hash(table.column("brand").combine_chunks())[train], return_counts=True)
    assert np.array_equal(merged.categories[j].values, hashes)
    assert np.array_equal(merged.categories[j].counts, counts)


def test_a_window_keeps_the_newest_segments(tmp_path: Path, demo_source: Path) -> None:
    _days(demo_source, tmp_path / "src", 4)
    everything = pack_stage(_config(tmp_path / "root", tmp_path / "src"))
    by_count = pack_stage(_config(tmp_path / "root", tmp_path / "src", "data.window.last_segments=2"))
    manifest = require_manifest(Path(by_count.dataset_dir))
    assert [s.source for s in manifest.segments] == ["day-02.parquet", "day-03.parquet"]
    assert by_count.segments_packed == 0 and by_count.rows["train"] < everything.rows["train"]
    # Older segments left the dataset but stay stored while a kept dataset lists them: widening
    # the window again packs nothing.
    assert pack_stage(_config(tmp_path / "root", tmp_path / "src")).fingerprint == everything.fingerprint
    by_days = pack_stage(_config(tmp_path / "root", tmp_path / "src", "data.time_column=ts",
                                 "data.window.last_days=1.5"))
    assert [s.source for s in require_manifest(Path(by_days.dataset_dir)).segments] == ["day-02.parquet",
                                                                                         "day-03.parquet"]
    assert by_days.segments_packed == 4  # the time column is part of what a segment holds
    assert by_count.fingerprint != by_days.fingerprint


def test_retention_removes_segments_no_kept_dataset_lists(tmp_path: Path, demo_source: Path) -> None:
    days = _days(demo_source, tmp_path / "all", 3)
    source = tmp_path / "src"
    source.mkdir()
    os.link(days[0], source / days[0].name)
    config = _config(tmp_path / "root", source, "storage.keep_datasets=1")

    def written_earlier(packed: object, seconds: float) -> None:
        """Datasets are ordered by when their manifest was written: set it, rather than wait."""
        manifest = Path(packed.dataset_dir) / "manifest.json"  # type: ignore[attr-defined]
        at = manifest.stat().st_mtime - seconds
        os.utime(manifest, (at, at))

    first = pack_stage(config)
    written_earlier(first, 20)
    days[0].unlink()
    (source / days[0].name).unlink()  # day 0 leaves the source: its segment leaves the next datasets
    os.link(days[1], source / days[1].name)
    second = pack_stage(config)
    written_earlier(second, 10)
    os.link(days[2], source / days[2].name)
    assert second.segments_removed == 0  # day 0 is still listed by the first dataset, which is kept
    third = pack_stage(config)
    assert third.segments_removed == 1  # the first dataset is no longer one of the newest: day 0 goes
    datasets = tmp_path / "root" / "datasets"
    assert sorted(p.parent.name for p in datasets.glob("*/manifest.json")) == sorted([second.fingerprint,
                                                                                      third.fingerprint])
    assert len(list(datasets.glob("segments/*/segment.json"))) == 2 and first.fingerprint != second.fingerprint


def test_retention_on_a_fresh_machine_keeps_the_datasets_s3_holds(s3_bucket: str, s3_server: str, tmp_path: Path,
                                                                   demo_source: Path) -> None:
    """Every pod is a fresh machine: it holds only what it packed itself, yet the kept datasets
    are those on the shared root."""
    import boto3

    days = _days(demo_source, tmp_path / "all", 2)
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    os.link(days[0], tmp_path / "x" / days[0].name)
    os.link(days[1], tmp_path / "y" / days[1].name)

    def on(machine: str, source: Path) -> RetrainConfig:
        return load_config(overrides=[*small_overrides(tmp_path / "unused", source),
                                      *s3_overrides(s3_bucket, s3_server, tmp_path / machine),
                                      "storage.keep_datasets=3"])

    first = pack_stage(on("machine-a", tmp_path / "x"))
    second = pack_stage(on("machine-b", tmp_path / "y"))  # a fresh home on the same root
    assert second.segments_removed == 0
    raw = boto3.client("s3", endpoint_url=s3_server)
    keys = {o["Key"] for page in raw.get_paginator("list_objects_v2").paginate(Bucket=s3_bucket)
            for o in page.get("Contents", [])}
    prefix = "team/retrain/datasets"
    listed = require_manifest(Path(first.dataset_dir)).segments
    assert listed and all(f"{prefix}/segments/{s.key}/segment.json" in keys for s in listed)
    assert f"{prefix}/{first.fingerprint}/manifest.json" in keys

    # Keeping none besides the current one removes the other dataset whole: no dangling manifest.
    third = pack_stage(load_config(overrides=[*small_overrides(tmp_path / "unused", tmp_path / "y"),
                                              *s3_overrides(s3_bucket, s3_server, tmp_path / "machine-c"),
                                              "storage.keep_datasets=0"]))
    assert third.segments_removed == len(listed)
    keys = {o["Key"] for page in raw.get_paginator("list_objects_v2").paginate(Bucket=s3_bucket)
            for o in page.get("Contents", [])}
    assert not any(k.startswith(f"{prefix}/{first.fingerprint}/") for k in keys)


def test_on_s3_a_segment_is_uploaded_once(s3_bucket: str, s3_server: str, tmp_path: Path, demo_source: Path) -> None:
    days = _days(demo_source, tmp_path / "all", 4)
    source = tmp_path / "src"
    source.mkdir()
    for path in days[:3]:
        os.link(path, source / path.name)
    config = load_config(overrides=[*small_overrides(tmp_path / "unused", source),
                                    *s3_overrides(s3_bucket, s3_server, tmp_path / "machine")])
    first = pack_stage(config)
    os.link(days[3], source / days[3].name)
    grown = pack_stage(config)
    assert grown.segments_packed == 1
    assert grown.uploaded_bytes <= 1.2 * (first.uploaded_bytes / 3)


def test_an_s3_source_is_read_by_range_and_once(s3_bucket: str, s3_server: str, tmp_path: Path,
                                                demo_source: Path) -> None:
    import boto3

    raw = boto3.client("s3", endpoint_url=s3_server)
    days = _days(demo_source, tmp_path / "all", 3)
    for path in days[:2]:
        raw.upload_file(str(path), s3_bucket, f"incoming/{path.name}")
    config = load_config(overrides=[*small_overrides(tmp_path / "unused", demo_source),
                                    *s3_overrides(s3_bucket, s3_server, tmp_path / "machine"),
                                    f"data.source=s3://{s3_bucket}/incoming/"])
    first = pack_stage(config)
    sizes = [p.stat().st_size for p in days]
    assert first.segments == 2 and first.source_bytes_read <= 1.2 * sum(sizes[:2])
    raw.upload_file(str(days[2]), s3_bucket, f"incoming/{days[2].name}")
    grown = pack_stage(config)
    assert grown.segments_packed == 1 and grown.source_bytes_read <= 1.2 * sizes[2]
    local = pack_stage(_config(tmp_path / "local", tmp_path / "all"))  # the same files, read from disk
    assert local.fingerprint == grown.fingerprint


# ---- train.retrain_when: a run with nothing to learn keeps the champion ----

def _champion(config: RetrainConfig) -> None:
    from training.pipeline.evaluate_stage import evaluate_stage
    from training.pipeline.preprocess_stage import preprocess_stage
    from training.pipeline.train_stage import train_stage
    from training.registry.champion import champion_of

    packed = pack_stage(config)
    prep = preprocess_stage(packed.dataset_dir, config.preprocess, config.storage)
    evaluation = evaluate_stage(config, packed, train_stage(config, packed, prep, champion_of(config)))
    assert evaluation.promotion.promoted


def test_retrain_when_drift_trains_only_on_drift_or_a_worse_champion(tmp_path: Path, demo_source: Path) -> None:
    from training.pipeline.decide_stage import decide_stage

    days = _days(demo_source, tmp_path / "all", 4, with_id=False)
    source = tmp_path / "src"
    source.mkdir()
    for path in days[:2]:
        os.link(path, source / path.name)
    config = _config(tmp_path / "root", source, "train.retrain_when=drift", "eval.min_delta=0.08",
                     "train.max_steps=200")
    _champion(config)

    same = decide_stage(config, pack_stage(config))
    assert not same.train and same.reason == "no data new since the champion was trained"

    os.link(days[2], source / days[2].name)  # a day like the others
    calm = decide_stage(config, pack_stage(config))
    assert not calm.train, calm.reason
    assert calm.new_segments == 1 and calm.new_rows == 2000 and max(calm.drift.values()) < 0.1
    assert "no feature drifted" in calm.reason and calm.champion_metric_new is not None

    table = pq.read_table(days[3])  # a day whose prices tripled
    pq.write_table(table.set_column(table.schema.get_field_index("price"), "price",
                                    pc.multiply(table.column("price"), 3.0)), source / "day-03.parquet")
    drifted = decide_stage(config, pack_stage(config))
    assert drifted.train and drifted.drifted == ["price"] and "drift over train.drift_threshold" in drifted.reason

    config.train.retrain_when = "degraded"  # drift alone does not train; a worse champion does
    assert not decide_stage(config, pack_stage(config)).train
    flipped = table.set_column(table.schema.get_field_index("clicked"), "clicked",
                               pc.subtract(1, table.column("clicked")))
    pq.write_table(flipped, source / "day-03.parquet")
    worse = decide_stage(config, pack_stage(config))
    assert worse.train and "worse by more than eval.min_delta" in worse.reason
    assert worse.champion_metric_new is not None and worse.champion_metric_new < 0.5
    assert json.loads(worse.model_dump_json())["mode"] == "degraded"


def test_every_arrow_time_type_windows_by_day(tmp_path: Path, demo_source: Path) -> None:
    """pandas writes nanosecond timestamps, a nanosecond count does not fit a float64 exactly,
    and dates and zone-aware times are ordinary too: each gives the same window."""
    import pytest

    from training.errors import DataError

    table = pq.read_table(demo_source)
    base = np.datetime64("2026-01-01T17:08:25", "ns")
    kinds = {
        "ns": lambda days: pa.array(base + days * np.timedelta64(86_400, "s"), pa.timestamp("ns")),
        "ms-utc": lambda days: pa.array(base + days * np.timedelta64(86_400, "s"), pa.timestamp("ns")).cast(
            pa.timestamp("ms", tz="UTC")),
        "us-zone": lambda days: pa.array(base + days * np.timedelta64(86_400, "s"), pa.timestamp("ns")).cast(
            pa.timestamp("us", tz="Europe/Paris")),
        "date": lambda days: pa.array((base + days * np.timedelta64(86_400, "s")).astype("datetime64[D]"),
                                      pa.date32()),
    }
    for kind, column in kinds.items():
        source = tmp_path / kind
        source.mkdir()
        per = table.num_rows // 4
        for d in range(4):
            part = table.slice(d * per, per)
            pq.write_table(part.append_column("ts", column(np.full(part.num_rows, d))), source / f"day-{d}.parquet")
        packed = pack_stage(_config(tmp_path / f"root-{kind}", source, "data.time_column=ts",
                                    "data.window.last_days=1.5"))
        kept = [s.source for s in require_manifest(Path(packed.dataset_dir)).segments]
        assert kept == ["day-2.parquet", "day-3.parquet"], kind

    source = tmp_path / "infinite"
    source.mkdir()
    pq.write_table(table.append_column("ts", pa.array(np.full(table.num_rows, np.inf))), source / "day-0.parquet")
    with pytest.raises(DataError, match="day-0.parquet: data.time_column 'ts' holds an infinite value"):
        pack_stage(_config(tmp_path / "root-inf", source, "data.time_column=ts"))


def test_rows_that_a_null_split_key_or_a_null_time_send_away_are_counted_in_a_warning(
        tmp_path: Path, demo_source: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    import logging

    table = pq.read_table(demo_source).slice(0, 4000)
    source = tmp_path / "src"
    source.mkdir()
    keys = pa.array(np.arange(table.num_rows) % 50).cast(pa.string())
    stamps = pa.array(np.full(table.num_rows, 1_700_000_000), pa.int64()).cast(pa.timestamp("s"))
    pq.write_table(table.append_column("user", keys).append_column("ts", stamps), source / "day-0.parquet")
    pq.write_table(table.append_column("user", pa.nulls(table.num_rows, pa.string()))
                   .append_column("ts", pa.nulls(table.num_rows, pa.timestamp("s"))), source / "day-1.parquet")
    with caplog.at_level(logging.WARNING):
        pack_stage(_config(tmp_path / "root", source, "data.split_key=user", "data.time_column=ts",
                           "data.window.last_days=30"))
    assert "day-1.parquet: data.split_key 'user' is null in 4000 of 4000 rows" in caplog.text
    assert "4000 rows of day-1.parquet have no time" in caplog.text


def test_reading_shards_keeps_their_verification_valid(small_config: RetrainConfig) -> None:
    """The next run skips hashing a shard whose size and mtime match its verification record: a
    read (which marks the shard recently used for the S3 cache's eviction) must not change them."""
    from training.data.manifest import segments_dir
    from training.data.load.shard_cache import local_shard

    packed = pack_stage(small_config)
    dataset = Path(packed.dataset_dir)
    manifest = require_manifest(dataset)
    for shard in manifest.shards:
        folder = shard_folder(dataset, shard)
        before = (folder / shard.name).stat().st_mtime_ns
        path, downloaded = local_shard(folder, shard.name, shard.bytes, shard.sha256)
        assert not downloaded and path.stat().st_mtime_ns == before
    for ref in manifest.segments:
        folder = segments_dir(dataset) / ref.key
        record = json.loads((folder.parent / f".{folder.name}.verified.json").read_text())
        now = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in folder.glob("*.tar")}
        assert {name: stamp for name, stamp in record.items() if name.endswith(".tar")} == now


def test_a_rerun_with_nothing_new_reads_no_statistics_file(small_config: RetrainConfig, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A reused segment's statistics are checked once, then known by their size and mtime, as its
    shards are: a run with nothing new costs a listing and a stat per file."""
    import training.data.ingest.segments as segments

    pack_stage(small_config)  # packed: its shards and statistics are recorded as verified
    parsed: list[int] = []
    real = segments.parse_stats_arrays
    monkeypatch.setattr(segments, "parse_stats_arrays", lambda data: parsed.append(len(data)) or real(data))
    assert pack_stage(small_config).reused and parsed == []
