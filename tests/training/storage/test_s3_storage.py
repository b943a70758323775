"""S3 storage against moto's real HTTP server on 127.0.0.1, with faults injected by a TCP proxy."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import boto3
import pytest

from tests.conftest import S3_SECRET, s3_overrides, small_overrides
from training.protocol.events import ChildEvent
from training.trainer.checkpoint_sync import remote_checkpoints
from training.config import StorageConfig, load_config
from training.errors import StorageError
from training.storage.s3 import CLASS_TAG, S3Settings, S3Store
from training.storage.root import StorageRoot


def _store(bucket: str, endpoint: str, **kw: object) -> S3Store:
    settings = dict(bucket=bucket, prefix="p", endpoint_url=endpoint, connect_timeout_s=1.0, read_timeout_s=2.0,
                    max_attempts=4, multipart_bytes=5 << 20)
    settings.update(kw)
    return S3Store(S3Settings(**settings))  # type: ignore[arg-type]


def _blob(path: Path, mb: float) -> str:
    data = os.urandom(int(mb * (1 << 20)))
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_multipart_upload_with_checksums_tags_and_resumable_download(s3_bucket, s3_server, fault_proxy, tmp_path):
    src = tmp_path / "big.bin"
    digest = _blob(src, 12)
    store = _store(s3_bucket, fault_proxy.url)
    store.upload_file("x/big.bin", src, {"team": "ranking", CLASS_TAG: "shard-cache"})
    raw = boto3.client("s3", endpoint_url=s3_server)
    head = raw.head_object(Bucket=s3_bucket, Key="p/x/big.bin", PartNumber=1)
    assert head["PartsCount"] == 3  # 12 MB in 5 MB parts
    assert store.tags_of("x/big.bin") == {"team": "ranking", CLASS_TAG: "shard-cache"}

    # A connection that breaks mid-body resumes from the byte it reached, not from zero.
    fault_proxy.requests.clear()
    fault_proxy.cut_after = 3 << 20
    before = fault_proxy.response_bytes
    out = store.download_file("x/big.bin", tmp_path / "copy.bin", sha256=digest)
    assert _sha(out) == digest
    assert fault_proxy.cuts == 1
    ranged = [start for method, path, start in fault_proxy.requests if method == "GET" and start]
    assert len(ranged) == 1 and ranged[0] >= 2 << 20
    # The bytes served are the cut stream plus only the remainder from where the client resumed
    # (which may be short of the cut: bytes in flight when the socket broke are lost); headers aside.
    served = fault_proxy.response_bytes - before
    assert served <= (3 << 20) + ((12 << 20) - ranged[0]) + (64 << 10)


@pytest.mark.parametrize("fault", ["reset", "503", "slow", "restart"])
def test_transient_faults_during_upload_are_retried_and_lose_nothing(fault, s3_bucket, s3_server, fault_proxy, tmp_path):
    src = tmp_path / "part.bin"
    digest = _blob(src, 11)
    store = _store(s3_bucket, fault_proxy.url, max_attempts=6)
    if fault == "reset":
        fault_proxy.cut_request_after = 2 << 20  # a part upload dies with RST 2 MB in
    elif fault == "503":
        fault_proxy.fail(3)
    elif fault == "slow":
        fault_proxy.delay_once = 3.5  # longer than the 2 s read timeout
    else:
        # The endpoint vanishes for 2 s once the upload is under way, as in a server restart.
        import threading

        threading.Timer(0.05, fault_proxy.restart, args=(2.0,)).start()
    store.upload_file("t/part.bin", src, {CLASS_TAG: "checkpoint"})
    raw = boto3.client("s3", endpoint_url=s3_server)
    body = raw.get_object(Bucket=s3_bucket, Key="p/t/part.bin")["Body"].read()
    assert hashlib.sha256(body).hexdigest() == digest
    if fault == "reset":
        assert fault_proxy.cuts == 1


def _one_line(err: StorageError) -> str:
    text = str(err)
    assert "\n" not in text
    assert S3_SECRET not in text and os.environ["AWS_ACCESS_KEY_ID"] not in text
    return text


def test_missing_bucket_fails_fast_naming_it(s3_server):
    store = _store("no-such-bucket-here", s3_server)
    with pytest.raises(StorageError) as info:
        store.check_bucket()
    text = _one_line(info.value)
    assert "no-such-bucket-here" in text and "does not exist" in text and s3_server in text
    assert info.value.transient is False  # no task retry: it will not get better


def test_wrong_endpoint_fails_in_bounded_time_naming_it(tmp_path):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    store = _store("some-bucket", f"http://127.0.0.1:{port}", max_attempts=2)
    with pytest.raises(StorageError) as info:
        store.check_bucket()
    text = _one_line(info.value)
    assert f"127.0.0.1:{port}" in text and "some-bucket" in text
    assert info.value.transient is True


def test_network_that_stays_down_fails_in_bounded_time(s3_bucket, fault_proxy, tmp_path):
    fault_proxy.blackhole = True  # connections open, nothing ever answers
    store = _store(s3_bucket, fault_proxy.url, max_attempts=2, read_timeout_s=1.0)
    src = tmp_path / "f.bin"
    _blob(src, 0.1)
    with pytest.raises(StorageError) as info:
        store.upload_file("f.bin", src, {})
    text = _one_line(info.value)
    assert fault_proxy.url.split("//")[1] in text and s3_bucket in text


def test_access_denied_names_bucket_without_credentials(tmp_path):
    """A second moto server with authentication on: our key is unknown to it."""
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1)
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)
        store = _store("locked-bucket", f"http://127.0.0.1:{port}")
        with pytest.raises(StorageError) as info:
            store.check_bucket()
        text = _one_line(info.value)
        assert "access denied" in text and "locked-bucket" in text
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_lifecycle_rules_merge_with_foreign_rules_idempotently(s3_bucket, s3_server, tmp_path):
    raw = boto3.client("s3", endpoint_url=s3_server)
    foreign = {"ID": "logs-expire", "Status": "Enabled", "Filter": {"Prefix": "logs/"}, "Expiration": {"Days": 3}}
    raw.put_bucket_lifecycle_configuration(Bucket=s3_bucket, LifecycleConfiguration={"Rules": [foreign]})
    config = load_config(overrides=s3_overrides(s3_bucket, s3_server, tmp_path / "local"))
    root = StorageRoot.from_config(config)
    assert root.prepare().lifecycle_updated is True
    assert root.prepare().lifecycle_updated is False  # idempotent: nothing written the second time

    rules = {r["ID"]: r for r in raw.get_bucket_lifecycle_configuration(Bucket=s3_bucket)["Rules"]}
    assert rules["logs-expire"]["Expiration"] == {"Days": 3}  # never touched
    ckpt = rules["retrain:team/retrain:checkpoints"]
    assert ckpt["Transitions"] == [{"Days": 7, "StorageClass": "GLACIER_IR"}]
    assert ckpt["Expiration"] == {"Days": 30}
    assert ckpt["Filter"]["And"]["Tags"] == [{"Key": CLASS_TAG, "Value": "checkpoint"}]
    assert ckpt["Filter"]["And"]["Prefix"] == "team/retrain/"
    assert rules["retrain:team/retrain:shard-cache"]["Expiration"] == {"Days": 30}
    assert rules["retrain:team/retrain:abort-multipart"]["AbortIncompleteMultipartUpload"] == {"DaysAfterInitiation": 1}

    # A changed setting replaces our rule by id; a second root in the same bucket adds its own.
    config.storage.lifecycle.checkpoint_transition_days = 3
    assert StorageRoot.from_config(config).prepare().lifecycle_updated is True
    other = load_config(overrides=s3_overrides(s3_bucket, s3_server, tmp_path / "local2", prefix="other"))
    StorageRoot.from_config(other).prepare()
    rules = {r["ID"]: r for r in raw.get_bucket_lifecycle_configuration(Bucket=s3_bucket)["Rules"]}
    assert rules["retrain:team/retrain:checkpoints"]["Transitions"][0]["Days"] == 3
    assert "retrain:other:checkpoints" in rules and "logs-expire" in rules
    assert len(rules) == 7


def test_config_rejects_bad_storage_settings():
    from training.errors import ConfigError

    with pytest.raises(ConfigError, match="checkpoint_expire_days"):
        load_config(overrides=["storage.lifecycle.checkpoint_expire_days=3"])
    with pytest.raises(ConfigError, match="only local folders and s3://"):
        load_config(overrides=["storage.root=gs://bucket/x"])
    with pytest.raises(ConfigError, match="reserved"):
        load_config(overrides=["cost.tags={retrain-class: x}"])
    assert StorageConfig(root="s3://b/p").is_s3


def test_shard_cache_streams_shards_on_demand_within_its_size_limit(s3_bucket, s3_server, demo_source, tmp_path):
    """Pack on one machine, train on another whose shard cache holds only a few shards."""
    from training.pipeline.pack_stage import pack_stage

    s3 = s3_overrides(s3_bucket, s3_server, tmp_path / "machine-a")
    config = load_config(overrides=small_overrides(tmp_path / "unused", demo_source) + s3)
    packed = pack_stage(config)
    assert packed.uploaded_bytes > 0 and packed.dataset_uri.startswith("s3://")

    config_b = load_config(overrides=small_overrides(tmp_path / "unused", demo_source) + s3
                           + [f"storage.local_dir={tmp_path / 'machine-b'}", "storage.shard_cache_gb=0.0002"])
    packed_b = pack_stage(config_b)
    assert packed_b.reused and packed_b.uploaded_bytes == 0
    dataset_dir = Path(packed_b.dataset_dir)
    segments = dataset_dir.parent / "segments"
    assert not list(segments.glob("*/*.tar"))  # only the manifests came down

    from training.data.prepare.features import FeatureStats
    from training.data.load.loader import ShardBatches, iter_split
    from training.data.manifest import load_manifest

    manifest = load_manifest(dataset_dir)
    local_manifest = load_manifest(Path(packed.dataset_dir))
    assert manifest == local_manifest
    stats = FeatureStats(numeric=manifest.numeric, categorical=manifest.categorical, mean=[0.0] * len(manifest.numeric),
                         std=[1.0] * len(manifest.numeric), vocab=[[] for _ in manifest.categorical], key="k")
    a = ShardBatches(dataset_dir, manifest, "train", 512, stats.transformer(), shuffle=False, drop_last=False)
    b = ShardBatches(Path(packed.dataset_dir), local_manifest, "train", 512, stats.transformer(), shuffle=False,
                     drop_last=False)
    for batch_a, batch_b in zip(iter_split(a), iter_split(b), strict=True):
        assert all((batch_a[k] == batch_b[k]).all() for k in ("num", "cat", "label"))
    cached = sum(p.stat().st_size for p in segments.glob("*/*.tar"))
    biggest = max(s.bytes for s in manifest.shards)
    assert cached <= 0.0002 * (1 << 30) + biggest  # bounded by the limit plus the shard in use
    assert len(manifest.shards_of("train")) > len(list(segments.glob("*/*.tar")))


@pytest.mark.slow
def test_kill_during_checkpoint_upload_then_a_fresh_machine_resumes_correctly(
    s3_bucket, s3_server, fault_proxy, demo_source, tmp_path
):
    """SIGKILL while a checkpoint's manifest upload is in flight; a second machine resumes from
    the last complete checkpoint on S3, ends bit-identical to an uninterrupted run, and counts
    the work the first machine lost past that checkpoint (from the heartbeat on S3)."""
    import json
    import struct
    import threading
    import time

    from tests.training.helpers import make_job
    from training.errors import Preempted
    from training.launch.process import run_training_process

    # 300 steps, not 60: the S3 heartbeat (every 0.1 s) must publish a step past 10 before
    # training ends. On an idle CI machine steps 10-60 took under 0.1 s, no heartbeat went out,
    # and the run ended (its last manifest held) before the kill.
    base = small_overrides(tmp_path / "local-root", demo_source) + ["train.checkpoint.every=10", "train.max_steps=300"]
    reference = run_training_process(make_job(load_config(overrides=base)))

    def config_for(machine: str):
        return load_config(overrides=base + s3_overrides(s3_bucket, fault_proxy.url, tmp_path / machine)
                           + ["storage.heartbeat_seconds=0.1"])

    job = make_job(config_for("machine-a"))
    raw = boto3.client("s3", endpoint_url=s3_server)
    published: list[int] = []

    def remote_step() -> int:
        try:
            body = raw.get_object(Bucket=s3_bucket, Key=f"team/retrain/{job.run_rel}/heartbeat.json")["Body"].read()
        except raw.exceptions.NoSuchKey:
            return -1
        return json.loads(body)["step"]
    # Let the step-10 checkpoint through; hold the manifest of any later one on the wire.
    fault_proxy.hold = lambda method, path: (method == "PUT" and "/checkpoints/step-" in path
                                             and path.endswith("manifest.json") and "step-00000010/" not in path)

    def kill_when_held(proc):
        def watch():
            if fault_proxy.held.wait(300):
                # Past the last complete checkpoint (10) on S3's heartbeat too: that is the
                # work a fresh machine must count as lost.
                deadline = time.time() + 180
                while remote_step() <= 10 and time.time() < deadline:
                    time.sleep(0.05)
                published.append(remote_step())
                proc.kill()
        threading.Thread(target=watch, daemon=True).start()

    with pytest.raises(Preempted):
        run_training_process(job, on_start=kill_when_held)
    fault_proxy.release()
    reached = struct.unpack("<qd", (Path(job.run_dir) / "heartbeat.bin").read_bytes())[0]  # machine A's truth

    root = StorageRoot.from_config(config_for("machine-a"))
    remote = remote_checkpoints(root, f"{job.run_rel}/checkpoints")
    assert "manifest.json" in remote[10]
    torn = [step for step in remote if step > 10]
    assert torn and all("manifest.json" not in remote[s] for s in torn)  # state uploaded, manifest never

    events: list[ChildEvent] = []
    job_b = make_job(config_for("machine-b"))
    result = run_training_process(job_b, on_event=events.append)
    assert [e.step for e in events if e.event == "resumed"] == [10]
    assert result.model.sha256 == reference.model.sha256
    # Lost: what A did past step 10, to within one heartbeat interval (its last publish).
    assert published[0] > 10
    assert published[0] - 10 <= result.steps_lost <= reached - 10
    remote = remote_checkpoints(root, f"{job.run_rel}/checkpoints")
    assert remote and all("manifest.json" in files for files in remote.values())  # the torn one is gone
    assert root.remote.head(f"{job.run_rel}/result.json") is not None



def test_a_checkpoint_manifest_on_s3_naming_a_path_outside_is_refused(s3_bucket, s3_server, tmp_path, caplog):
    """A tampered manifest must not make a fresh machine write outside its working copy."""
    import json
    import logging

    from training.trainer.checkpoint_sync import restore_newer_checkpoint

    config = load_config(overrides=s3_overrides(s3_bucket, s3_server, tmp_path / "machine" / "copy"))
    root = StorageRoot.from_config(config)
    ckpt_rel = "runs/r/checkpoints"
    evil, body = "../../../../../escaped.txt", b"written from a tampered manifest"
    manifest = {"step": 10, "run_key": "r", "config_fingerprint": "x",
                "files": {evil: {"sha256": hashlib.sha256(body).hexdigest(), "bytes": len(body)}}}
    raw = boto3.client("s3", endpoint_url=s3_server)
    step = f"team/retrain/{ckpt_rel}/step-00000010"
    raw.put_object(Bucket=s3_bucket, Key=f"{step}/{evil}", Body=body)
    raw.put_object(Bucket=s3_bucket, Key=f"{step}/manifest.json", Body=json.dumps(manifest).encode())
    ckpt_dir = root.local / ckpt_rel
    ckpt_dir.mkdir(parents=True)
    with caplog.at_level(logging.WARNING):
        assert restore_newer_checkpoint(root, ckpt_rel, ckpt_dir) is None
    assert not list(tmp_path.rglob("escaped.txt"))
    assert "outside the checkpoint" in caplog.text



def test_as_many_threads_as_planning_uses_share_the_pool_without_dropping_connections(s3_bucket, s3_server, caplog):
    """Planning reads footers PLAN_THREADS at a time through one client: a pool smaller than
    that drops and reopens connections, and urllib3 warns "Connection pool is full"."""
    import logging
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from training.data.ingest.packing import PLAN_THREADS

    store = _store(s3_bucket, s3_server)
    store.put_bytes("x", b"1", {})
    start = threading.Barrier(PLAN_THREADS)

    def ask(_: int) -> None:
        for _ in range(5):
            start.wait()
            assert store.head("x") is not None

    with caplog.at_level(logging.WARNING, logger="urllib3.connectionpool"), \
            ThreadPoolExecutor(max_workers=PLAN_THREADS) as pool:
        list(pool.map(ask, range(PLAN_THREADS)))
    assert not [r for r in caplog.records if "Connection pool is full" in r.getMessage()]
