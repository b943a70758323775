"""S3 storage: the loop's stall per checkpoint with the background uploader vs a synchronous
upload, and shard read throughput from the S3 endpoint vs the same shards on local disk.

The endpoint is moto's S3 server on 127.0.0.1 (the only network a benchmark may use), so the
"network" is loopback plus moto's request handling: the figures are ratios in one run, not a
claim about AWS bandwidth.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_checkpoint import _state
from benchmarks.common import demo_parquet

STEPS = 5


def _server() -> tuple[Any, str]:
    from moto.server import ThreadedMotoServer

    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_EC2_METADATA_DISABLED": "true"})
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    return server, f"http://127.0.0.1:{server.get_host_and_port()[1]}"


def _read_all(dataset_dir: Path) -> float:
    """Rows/s reading every train batch once, as the training loop would (unshuffled)."""
    from training.data.prepare.features import FeatureStats
    from training.data.load.loader import ShardBatches
    from training.data.manifest import load_manifest

    manifest = load_manifest(dataset_dir)
    assert manifest is not None
    stats = FeatureStats(manifest.numeric, manifest.categorical, [0.0] * len(manifest.numeric),
                         [1.0] * len(manifest.numeric), [[] for _ in manifest.categorical])
    batches = ShardBatches(dataset_dir, manifest, "train", 1024, stats.transformer(), shuffle=False, drop_last=False)
    t0 = time.perf_counter()
    for i in range(batches.batches_per_epoch):
        batches.batch(0, i)
    return batches.rows / (time.perf_counter() - t0)


def run(work: Path) -> dict[str, Any]:
    import boto3

    from training.trainer.checkpoint import AsyncCheckpointer, CheckpointManifest, save_checkpoint
    from training.trainer.checkpoint_sync import CheckpointUploader
    from training.config import load_config
    from training.data.manifest import require_manifest
    from training.pipeline.pack_stage import pack_stage
    from training.storage.root import StorageRoot

    server, endpoint = _server()
    try:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench-bucket")
        s3 = ["storage.root=s3://bench-bucket/retrain", f"storage.endpoint_url={endpoint}"]
        config = load_config(overrides=[*s3, f"storage.local_dir={work / 'machine-a'}"])
        root = StorageRoot.from_config(config)
        state = _state()

        # 1. Background upload: the loop waits for the in-memory copy only.
        uploader = CheckpointUploader(root, "runs/bench", "bench", keep_last=2)
        checkpointer = AsyncCheckpointer(root.local / "runs/bench/checkpoints", 2, on_published=uploader.submit)
        stalls = []
        for step in range(1, STEPS + 1):
            t0 = time.perf_counter()
            checkpointer.save(CheckpointManifest(step, "bench", "bench", {}), state, set())
            stalls.append(time.perf_counter() - t0)
            checkpointer.wait()
            uploader.flush()  # measure each stall alone, not queued behind the previous upload
        upload_seconds = uploader.seconds / STEPS
        uploader.close()

        # 2. Reference: save and upload in the loop's own thread, as a naive loop would.
        sync_root = root.local / "runs/sync/checkpoints"
        sync = []
        assert root.remote is not None
        for step in range(1, STEPS + 1):
            t0 = time.perf_counter()
            path = save_checkpoint(sync_root, CheckpointManifest(step, "bench", "bench", {}), state)
            for f in ("state.pt", "manifest.json"):
                root.remote.upload_file(f"runs/sync/checkpoints/{path.name}/{f}", path / f, root.tags("checkpoint"))
            sync.append(time.perf_counter() - t0)
        state_mb = (path / "state.pt").stat().st_size / 1e6

        # 3. Shards: pack 500k rows, publish, read them back on a "fresh machine" (cold cache),
        #    again (warm cache), and from the packing machine's local disk.
        source = demo_parquet(work, 500_000)
        packed = pack_stage(load_config(overrides=[*s3, f"storage.local_dir={work / 'machine-a'}",
                                                   f"data.source={source}"]))
        local_rate = max(_read_all(Path(packed.dataset_dir)) for _ in range(2))
        fresh = pack_stage(load_config(overrides=[*s3, f"storage.local_dir={work / 'machine-b'}",
                                                  f"data.source={source}"]))
        assert fresh.reused
        cold_rate = _read_all(Path(fresh.dataset_dir))
        warm_rate = _read_all(Path(fresh.dataset_dir))
        # The manifest's sizes: the shards live in the dataset's segments, not in its folder.
        shard_mb = sum(sh.bytes for sh in require_manifest(Path(packed.dataset_dir)).shards_of("train")) / 1e6
    finally:
        server.stop()
    return {
        "endpoint": "moto S3 server on 127.0.0.1",
        "checkpoint_state_mb": round(state_mb, 1),
        "loop_stall_per_checkpoint_background_s": round(min(stalls), 4),
        "loop_stall_per_checkpoint_synchronous_upload_s": round(min(sync), 3),
        "stall_ratio_background_vs_synchronous": round(min(stalls) / min(sync), 4),
        "background_upload_seconds_per_checkpoint": round(upload_seconds, 3),
        "train_shards_mb": round(shard_mb, 1),
        "shard_read_rows_per_s_local_disk": round(local_rate),
        "shard_read_rows_per_s_s3_cold_cache": round(cold_rate),
        "shard_read_rows_per_s_s3_warm_cache": round(warm_rate),
        "s3_cold_vs_local_ratio": round(cold_rate / local_rate, 3),
        "s3_warm_vs_local_ratio": round(warm_rate / local_rate, 3),
    }
