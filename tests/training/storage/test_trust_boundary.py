"""The storage root is a trust boundary: whoever can write it (a bucket policy, a shared folder)
must not be able to make a training machine write outside it, or read back anything but data.

Each test plants what an attacker or a careless operator could, then runs the stage that reads it.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
from pathlib import Path

import boto3
import numpy as np
import pytest

from tests.conftest import s3_overrides, small_overrides
from tests.training.helpers import make_job
from training.config import RetrainConfig, load_config
from training.data.shards import ShardReader, ShardTarWriter
from training.data.manifest import load_manifest
from training.errors import DamagedShard, DataError, StorageError
from training.pipeline.pack_stage import pack_stage
from training.pipeline.preprocess_stage import preprocess_stage
from training.pipeline.train_stage import train_stage
from training.registry.champion import champion_of
from training.storage.files import inside


def test_inside_refuses_names_and_links_that_leave_the_folder(tmp_path: Path) -> None:
    base = tmp_path / "root"
    (base / "runs").mkdir(parents=True)
    assert inside(base, "runs/abc/checkpoints") == base / "runs" / "abc" / "checkpoints"
    for rel in ("../x", "runs/../../x", "/etc/passwd", "runs//x", "runs/a\\..\\b", "a\0b", ""):
        with pytest.raises(StorageError, match="not a path inside"):
            inside(base, rel)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (base / "runs" / "linked").symlink_to(outside)
    with pytest.raises(StorageError, match="symbolic link"):
        inside(base, "runs/linked/checkpoints")
    (base / "runs" / "inner").symlink_to(base / "runs")  # a link that stays inside is the user's business
    assert inside(base, "runs/inner/x") == base / "runs" / "inner" / "x"


def _escape_name(depth: int, target: Path) -> str:
    return "../" * depth + str(target).lstrip("/")


def _segment(packed_dataset: Path) -> tuple[Path, dict]:
    """The first segment of a packed dataset: its folder and its segment.json."""
    manifest = json.loads((packed_dataset / "manifest.json").read_text())
    folder = packed_dataset.parent / "segments" / manifest["segments"][0]["key"]
    return folder, json.loads((folder / "segment.json").read_text())


def test_a_tampered_manifest_on_s3_cannot_write_outside_the_working_copy(
        s3_bucket: str, s3_server: str, demo_source: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def config_for(machine: str) -> RetrainConfig:
        return load_config(overrides=[*small_overrides(tmp_path / "unused", demo_source),
                                      *s3_overrides(s3_bucket, s3_server, tmp_path / machine / "copy")])

    first = pack_stage(config_for("machine-a"))
    folder, segment = _segment(Path(first.dataset_dir))
    rel = f"team/retrain/datasets/segments/{folder.name}"
    raw = boto3.client("s3", endpoint_url=s3_server)
    victim = tmp_path / "victim" / "x.tar"
    victim.parent.mkdir()
    body = b"planted by whoever can write the bucket" * 100
    evil = _escape_name(12, victim)
    segment["shards"][0].update(name=evil, bytes=len(body), sha256=hashlib.sha256(body).hexdigest(), xxh3_128="")
    raw.put_object(Bucket=s3_bucket, Key=f"{rel}/{evil}", Body=body)
    raw.put_object(Bucket=s3_bucket, Key=f"{rel}/segment.json", Body=json.dumps(segment).encode())
    # A dataset without its segment catalog: the fresh machine reads each segment.json (a
    # catalog is checked as they are: tests/training/data/test_segment_catalog.py).
    raw.delete_object(Bucket=s3_bucket, Key=f"team/retrain/datasets/{first.fingerprint}/segments.json")

    config = config_for("machine-b")
    with caplog.at_level(logging.WARNING):
        packed = pack_stage(config)  # a fresh machine: it finds the segment on S3, then reads its shards
        prep = preprocess_stage(packed.dataset_dir, config.preprocess, config.storage)
        trained = train_stage(config, packed, prep, champion_of(config))
    assert not victim.exists()
    assert "lists a shard that is not a file of the segment" in caplog.text and "packing the segment again" in caplog.text
    assert not packed.reused and packed.fingerprint == first.fingerprint
    assert trained.status in ("completed", "early_stopped")
    repaired = json.loads(raw.get_object(Bucket=s3_bucket, Key=f"{rel}/segment.json")["Body"].read())
    assert all("/" not in s["name"] for s in repaired["shards"])  # the repack replaced the tampered manifest


def test_a_local_manifest_naming_a_file_outside_is_packed_again(
        small_config: RetrainConfig, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    first = pack_stage(small_config)
    folder, segment = _segment(Path(first.dataset_dir))
    outside = tmp_path / "outside.tar"
    shard = segment["shards"][0]
    outside.write_bytes((folder / shard["name"]).read_bytes())  # the right size and hashes: only the name is wrong
    shard["name"] = os.path.relpath(outside, folder)
    (folder / "segment.json").write_text(json.dumps(segment))
    with caplog.at_level(logging.WARNING):
        again = pack_stage(small_config)
    assert not again.reused and "lists a shard that is not a file of the segment" in caplog.text
    assert again.fingerprint == first.fingerprint
    verified = json.loads((folder.parent / f".{folder.name}.verified.json").read_text())
    assert all("/" not in name for name in verified)

    # The dataset's own manifest, tampered the same way, is refused when it is read.
    dataset = Path(again.dataset_dir)
    manifest = json.loads((dataset / "manifest.json").read_text())
    manifest["shards"][0]["name"] = "../../outside.tar"
    (dataset / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="lists a shard that is not a file of the dataset"):
        load_manifest(dataset)
    assert pack_stage(small_config).fingerprint == first.fingerprint  # and rewritten by the next pack
    assert load_manifest(dataset) is not None


@pytest.mark.parametrize("linked", ["run", "checkpoints"])
def test_a_run_folder_linked_out_of_the_root_is_refused(small_config: RetrainConfig, tmp_path: Path,
                                                        linked: str) -> None:
    packed = pack_stage(small_config)
    prep = preprocess_stage(packed.dataset_dir, small_config.preprocess, small_config.storage)
    run_dir = Path(make_job(small_config).run_dir)
    target = tmp_path / "not-the-root"
    target.mkdir()
    if linked == "run":
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        run_dir.symlink_to(target)
    else:
        run_dir.mkdir(parents=True)
        (run_dir / "checkpoints").symlink_to(target)
    with pytest.raises(StorageError, match="outside the storage root .* remove the link"):
        train_stage(small_config, packed, prep, champion_of(small_config))
    assert list(target.iterdir()) == []


def test_an_unchanged_run_record_on_s3_naming_a_path_outside_writes_nothing_there(
        s3_bucket: str, s3_server: str, demo_source: Path, tmp_path: Path) -> None:
    from training.pipeline.unchanged import _rel, find_unchanged

    config = load_config(overrides=[*small_overrides(tmp_path / "unused", demo_source),
                                    *s3_overrides(s3_bucket, s3_server, tmp_path / "machine" / "copy")])
    victim = tmp_path / "victim" / "report.json"
    victim.parent.mkdir()
    evil = _escape_name(12, victim)
    raw = boto3.client("s3", endpoint_url=s3_server)
    raw.put_object(Bucket=s3_bucket, Key=f"team/retrain/{evil}", Body=json.dumps({"run_key": "k"}).encode())
    record = {"run_key": "k", "dataset": "d", "source": str(demo_source), "champion_sha256": None, "report": evil}
    raw.put_object(Bucket=s3_bucket, Key=f"team/retrain/{_rel(config)}", Body=json.dumps(record).encode())
    assert find_unchanged(config) is None
    assert not victim.exists()


def _object_member(name: str) -> bytes:
    """A .npy member with an object dtype: numpy would unpickle it."""
    header = {"descr": "|O", "fortran_order": False, "shape": (2,)}
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    return buf.getvalue() + b"\0" * 16


def test_a_shard_with_an_object_member_is_damaged_and_packed_again(
        small_config: RetrainConfig, caplog: pytest.LogCaptureFixture) -> None:
    first = pack_stage(small_config)
    folder, segment = _segment(Path(first.dataset_dir))
    entry = segment["shards"][0]
    shard = folder / entry["name"]
    reader = ShardReader(shard)
    keys, fields = reader.keys, reader.fields
    reader.close()
    writer = ShardTarWriter(shard)
    for key in keys:
        for field in fields:
            writer.add(f"{key}.{field}.npy", _object_member(field))
    written = writer.close().result()
    # The manifest rewritten by the same hand: its hashes match the damaged shard.
    entry.update(bytes=written.bytes, sha256=written.sha256, xxh3_128=written.xxh3_128)
    (folder / "segment.json").write_text(json.dumps(segment))
    with pytest.raises(DamagedShard, match="holds object values, not numbers"):
        ShardReader(shard).block(keys[0])
    with caplog.at_level(logging.WARNING):
        again = pack_stage(small_config)
    assert not again.reused and "not numbers" in caplog.text


def _rewrite_stats(folder: Path, segment: dict, change: object) -> None:
    """Rewrite a segment's stats.npz with `change(arrays)` applied, and its sha256 in segment.json
    by the same hand, so only the values can tell."""
    from training.data.ingest.segment_stats import parse_stats_arrays

    arrays = parse_stats_arrays((folder / "stats.npz").read_bytes())
    change(arrays)  # type: ignore[operator]
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    data = buf.getvalue()
    (folder / "stats.npz").write_bytes(data)
    segment.update(stats_bytes=len(data), stats_sha256=hashlib.sha256(data).hexdigest())
    (folder / "segment.json").write_text(json.dumps(segment))


def _nan_mean(a: dict) -> None:
    a["num.mean"] = a["num.mean"].copy()
    a["num.mean"][0] = np.nan


def _inf_mean(a: dict) -> None:
    a["num.mean"] = np.full_like(a["num.mean"], np.inf)


def _negative_count(a: dict) -> None:
    a["cat0.counts"] = -a["cat0.counts"]


def _wrong_shape(a: dict) -> None:
    a["num.m2"] = a["num.m2"][:1]


def _missing(a: dict) -> None:
    del a["num.mean"]


@pytest.mark.parametrize("change", [_nan_mean, _inf_mean, _negative_count, _wrong_shape, _missing],
                         ids=lambda f: f.__name__.strip("_"))
def test_tampered_segment_statistics_are_damaged_and_packed_again(
        small_config: RetrainConfig, caplog: pytest.LogCaptureFixture, change: object) -> None:
    """Statistics are derived from the segment's rows: not finite, a negative count, a wrong
    shape or a missing array cannot be packing's, so the segment is packed again, and the
    features fitted on it are the untampered ones."""
    first = pack_stage(small_config)
    folder, segment = _segment(Path(first.dataset_dir))
    original = (folder / "stats.npz").read_bytes()
    _rewrite_stats(folder, segment, change)
    with caplog.at_level(logging.WARNING):
        again = pack_stage(small_config)
    assert not again.reused and "damaged or tampered with" in caplog.text
    assert (folder / "stats.npz").read_bytes() == original
    prep = preprocess_stage(again.dataset_dir, small_config.preprocess, small_config.storage)
    assert prep.stats_path and "nan" not in Path(prep.stats_path).read_text().lower()


def test_a_corrupt_statistics_file_heals_on_the_next_run(small_config: RetrainConfig,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    first = pack_stage(small_config)
    folder, _ = _segment(Path(first.dataset_dir))
    original = (folder / "stats.npz").read_bytes()
    (folder / "stats.npz").write_bytes(original[:-40] + b"\0" * 40)
    with caplog.at_level(logging.WARNING):
        again = pack_stage(small_config)
    assert "does not match its sha256" in caplog.text and (folder / "stats.npz").read_bytes() == original
    assert again.fingerprint == first.fingerprint


def test_a_tampered_row_count_in_segment_json_is_packed_again(small_config: RetrainConfig,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    first = pack_stage(small_config)
    folder, segment = _segment(Path(first.dataset_dir))
    segment["rows"]["train"] += 1000
    (folder / "segment.json").write_text(json.dumps(segment))
    with caplog.at_level(logging.WARNING):
        again = pack_stage(small_config)
    assert "damaged or tampered with" in caplog.text and again.fingerprint == first.fingerprint


def _two_day_source(tmp_path: Path, demo_source: Path) -> Path:
    import pyarrow.parquet as pq

    table = pq.read_table(demo_source)
    source = tmp_path / "days"
    source.mkdir()
    pq.write_table(table.slice(0, 4000), source / "day-0.parquet", row_group_size=2000)
    pq.write_table(table.slice(4000, 4000), source / "day-1.parquet", row_group_size=2000)
    return source


@pytest.mark.parametrize("tamper", ["point-at-another-file", "empty", "row-groups-out-of-range"])
def test_a_tampered_source_index_entry_is_checked_against_its_segments(
        tmp_path: Path, demo_source: Path, caplog: pytest.LogCaptureFixture, tamper: str) -> None:
    """The source index says which segments hold a file's rows; each segment's own segment.json
    says which file and row groups it was packed from. An entry that does not hold up is read
    again from the file, never reused silently, and never an IndexError."""
    source = _two_day_source(tmp_path, demo_source)
    config = load_config(overrides=small_overrides(tmp_path / "root", source))
    first = pack_stage(config)
    index_path = tmp_path / "root" / "datasets" / "source-index.json"
    index = json.loads(index_path.read_text())
    day0 = next(e for k, e in index["entries"].items() if k.endswith("|day-0.parquet"))
    day1 = next(e for k, e in index["entries"].items() if k.endswith("|day-1.parquet"))
    if tamper == "point-at-another-file":
        day1["segments"] = day0["segments"]
    elif tamper == "empty":
        day1["segments"] = []
    else:
        day1["segments"][0]["key"] = "0" * len(day1["segments"][0]["key"])  # gone: packed again
        day1["segments"][0]["row_groups"] = [0, 5, 99]
    index_path.write_text(json.dumps(index))
    with caplog.at_level(logging.WARNING):
        again = pack_stage(config)
    assert again.fingerprint == first.fingerprint
    assert sum(require_rows(Path(again.dataset_dir)).values()) == 8000


def require_rows(dataset_dir: Path) -> dict[str, int]:
    manifest = load_manifest(dataset_dir)
    assert manifest is not None
    return dict(manifest.rows)


@pytest.mark.parametrize("target", ["secret", "table"])
def test_a_link_in_a_source_folder_that_leads_out_of_it_is_refused_without_quoting_it(
        target: str, demo_source: Path, tmp_path: Path) -> None:
    """A source folder is shared with whoever drops files in it: a link named like a table that
    leads to a secret (its first line would be quoted by a parse error) or to another team's
    Parquet file is one line naming the link, and nothing is read through it."""
    from training.data.ingest.sources import open_source

    folder = tmp_path / "incoming"
    folder.mkdir()
    (folder / "day-00.parquet").write_bytes(demo_source.read_bytes())
    secret = tmp_path / "elsewhere" / "passwd"
    secret.parent.mkdir()
    secret.write_text("root:x:0:0:the first line of a secret\n")
    (folder / "day-01.csv").symlink_to(secret if target == "secret" else demo_source)
    (folder / "day-02.parquet").symlink_to(folder / "day-00.parquet")  # inside the folder: fine alone
    with pytest.raises(DataError, match=r"day-01.csv is a symbolic link to a file outside the folder") as err:
        open_source(folder).files()
    assert "root:x" not in str(err.value) and str(secret) not in str(err.value)
