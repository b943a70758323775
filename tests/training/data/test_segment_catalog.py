"""A fresh machine plans a source packed on S3 from the dataset's segment catalog: one GET,
not one GET of segment.json per segment. The catalog is root input: a damaged one costs only
the per-segment reads."""

from __future__ import annotations

import json
from pathlib import Path

import boto3
import pytest

from tests.conftest import s3_overrides, small_overrides
from training.config import load_config
from training.data.ingest.dataset_store import CATALOG, DatasetStore
from training.data.ingest.packing import pack_serially, plan_pack
from training.storage.root import StorageRoot


def _config(s3_bucket: str, endpoint: str, local: Path, source: Path):
    return load_config(overrides=small_overrides(local / "unused", source) + s3_overrides(s3_bucket, endpoint, local)
                       + ["data.segment_rows=2000"])


def _packed_on_machine_a(s3_bucket: str, s3_server: str, demo_source: Path, tmp_path: Path) -> list[str]:
    config = _config(s3_bucket, s3_server, tmp_path / "machine-a", demo_source)
    store = DatasetStore(StorageRoot(config.storage))
    plan, _ = plan_pack(demo_source, config.data, store, config.storage)
    manifest, _ = pack_serially(plan, config.data, store, config.storage)
    return sorted(s.key for s in manifest.segments)


def _gets(fault_proxy, name: str) -> int:
    return sum(1 for method, path, _ in fault_proxy.requests if method == "GET" and path.split("?")[0].endswith(name))


def test_a_fresh_machine_plans_from_one_catalog_get(s3_bucket: str, s3_server: str, fault_proxy, demo_source: Path,
                                                    tmp_path: Path) -> None:
    keys = _packed_on_machine_a(s3_bucket, s3_server, demo_source, tmp_path)
    assert len(keys) >= 4

    config = _config(s3_bucket, fault_proxy.url, tmp_path / "machine-b", demo_source)
    plan, _ = plan_pack(demo_source, config.data, DatasetStore(StorageRoot(config.storage)), config.storage)

    assert plan.todo == [] and sorted(s.key for s in plan.ready) == keys
    assert _gets(fault_proxy, "/" + CATALOG) == 1 and _gets(fault_proxy, "/segment.json") == 0


@pytest.mark.parametrize("damage", ["rows", "key", "shard", "garbage"])
def test_a_damaged_catalog_costs_only_the_per_segment_reads(damage: str, s3_bucket: str, s3_server: str, fault_proxy,
                                                            demo_source: Path, tmp_path: Path, caplog) -> None:
    keys = _packed_on_machine_a(s3_bucket, s3_server, demo_source, tmp_path)
    s3 = boto3.client("s3", endpoint_url=s3_server)
    (listed,) = [o["Key"] for o in s3.list_objects_v2(Bucket=s3_bucket)["Contents"] if o["Key"].endswith(CATALOG)]
    catalog = json.loads(s3.get_object(Bucket=s3_bucket, Key=listed)["Body"].read())
    if damage == "rows":
        catalog["segments"][0]["rows"]["train"] += 1  # not what its shards hold
    elif damage == "key":
        catalog["segments"][0]["key"] = "../../runs"
    elif damage == "shard":
        catalog["segments"][0]["shards"][0]["name"] = "../../../outside.tar"  # a path out of the working copy
    s3.put_object(Bucket=s3_bucket, Key=listed, Body=b"{" if damage == "garbage" else json.dumps(catalog).encode())

    config = _config(s3_bucket, fault_proxy.url, tmp_path / "machine-b", demo_source)
    plan, _ = plan_pack(demo_source, config.data, DatasetStore(StorageRoot(config.storage)), config.storage)

    assert plan.todo == [] and sorted(s.key for s in plan.ready) == keys
    assert _gets(fault_proxy, "/segment.json") == len(keys) and "its segments are read one by one" in caplog.text


def test_a_second_writer_of_a_dataset_leaves_the_first_ones_manifest_and_catalog(
        s3_bucket: str, s3_server: str, demo_source: Path, tmp_path: Path) -> None:
    """Both are written only where absent (If-None-Match): the fingerprint addresses the
    content, so the first writer's objects stand and a racing writer's never replace them."""
    _packed_on_machine_a(s3_bucket, s3_server, demo_source, tmp_path)
    s3 = boto3.client("s3", endpoint_url=s3_server)
    objects = {o["Key"]: o["ETag"] for o in s3.list_objects_v2(Bucket=s3_bucket)["Contents"]
               if o["Key"].endswith((CATALOG, "/manifest.json")) and "/segments/" not in o["Key"]}
    assert len(objects) == 2

    config = _config(s3_bucket, s3_server, tmp_path / "machine-b", demo_source)
    store = DatasetStore(StorageRoot(config.storage))
    plan, _ = plan_pack(demo_source, config.data, store, config.storage)
    from training.data.ingest.packing import dataset_of

    store.root.remote.head = lambda rel: None  # as a writer that checked before the first one wrote
    store.write_dataset(dataset_of(plan, plan.ready, config.data), plan.ready[:1])

    after = {o["Key"]: o["ETag"] for o in s3.list_objects_v2(Bucket=s3_bucket)["Contents"] if o["Key"] in objects}
    assert after == objects


def _dataset_object(s3, bucket: str, name: str) -> str:
    (key,) = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]
              if o["Key"].endswith("/" + name) and "/segments/" not in o["Key"]]
    return key


def test_a_planted_catalog_entry_loses_to_the_segments_own_record_and_is_replaced(
        s3_bucket: str, s3_server: str, demo_source: Path, tmp_path: Path, caplog) -> None:
    """A well-formed, newer catalog that gives an untouched segment's shard another sha256: the
    catalog is a fast path, so the segment's own segment.json wins, and the next write of the
    dataset replaces the catalog (over the version it read)."""
    _packed_on_machine_a(s3_bucket, s3_server, demo_source, tmp_path)
    s3 = boto3.client("s3", endpoint_url=s3_server)
    listed = _dataset_object(s3, s3_bucket, CATALOG)
    genuine = s3.get_object(Bucket=s3_bucket, Key=listed)["Body"].read()
    catalog = json.loads(genuine)
    target = catalog["segments"][0]
    real_sha = target["shards"][0]["sha256"]
    target["shards"][0]["sha256"] = "0" * 64
    s3.put_object(Bucket=s3_bucket, Key=listed, Body=json.dumps(catalog).encode())

    config = _config(s3_bucket, s3_server, tmp_path / "machine-b", demo_source)
    store = DatasetStore(StorageRoot(config.storage))
    plan, _ = plan_pack(demo_source, config.data, store, config.storage)
    used = {s.key: s for s in plan.ready}[target["key"]]
    assert used.shards[0].sha256 == real_sha and "reading the segment's own" in caplog.text

    pack_serially(plan, config.data, store, config.storage)
    assert s3.get_object(Bucket=s3_bucket, Key=listed)["Body"].read() == genuine


def test_a_tampered_dataset_manifest_on_s3_is_replaced_and_a_fresh_machine_then_trains(
        s3_bucket: str, s3_server: str, demo_source: Path, tmp_path: Path) -> None:
    """A manifest rewritten on S3 to drop a segment is not what packing writes under that
    fingerprint: the next pack (from a fresh machine) replaces it over the version it read, and
    a node on another fresh machine, which reads the dataset from S3 alone, gets it whole."""
    _packed_on_machine_a(s3_bucket, s3_server, demo_source, tmp_path)
    s3 = boto3.client("s3", endpoint_url=s3_server)
    listed = _dataset_object(s3, s3_bucket, "manifest.json")
    genuine = s3.get_object(Bucket=s3_bucket, Key=listed)["Body"].read()
    manifest = json.loads(genuine)
    dropped = manifest["segments"].pop()["key"]
    manifest["shards"] = [s for s in manifest["shards"] if s["segment"] != dropped]
    s3.put_object(Bucket=s3_bucket, Key=listed, Body=json.dumps(manifest).encode())

    config = _config(s3_bucket, s3_server, tmp_path / "machine-b", demo_source)
    store = DatasetStore(StorageRoot(config.storage))
    plan, _ = plan_pack(demo_source, config.data, store, config.storage)
    packed, _ = pack_serially(plan, config.data, store, config.storage)
    assert s3.get_object(Bucket=s3_bucket, Key=listed)["Body"].read() == genuine

    node = DatasetStore(StorageRoot(_config(s3_bucket, s3_server, tmp_path / "machine-c", demo_source).storage))
    folder = node.fetch_dataset(packed.fingerprint)
    assert folder is not None and (folder / "manifest.json").read_bytes() == genuine
