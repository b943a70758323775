"""A node of a multi-node job reads the frozen job its train task published, and nothing else
decides what it trains: not the source, not its own config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import s3_overrides, small_overrides
from tests.training.helpers import make_job
from training.config import StorageConfig, load_config
from training.errors import ConfigError, StorageError
from training.launch.group import publish_frozen_job
from training.protocol.job import TrainJob
from training.worker.node import node_job


def test_a_fresh_node_brings_down_the_frozen_jobs_data_and_writes_nothing_to_the_root(
        s3_bucket: str, s3_server: str, fault_proxy, demo_source: Path, tmp_path: Path) -> None:
    """Another machine (its own empty working copy) reaches S3 through a proxy that logs every
    request: it finds the job's dataset, segments and statistics, at its own paths, and not one
    request writes."""
    config = load_config(overrides=small_overrides(tmp_path / "unused", demo_source)
                         + s3_overrides(s3_bucket, s3_server, tmp_path / "machine-a") + ["train.distributed.nnodes=2"])
    job = make_job(config)
    rel, sha256 = publish_frozen_job(job)
    storage = StorageConfig.model_validate({**config.storage.model_dump(), "endpoint_url": fault_proxy.url,
                                            "local_dir": str(tmp_path / "machine-b")})

    got = node_job(job.run_key, rel, storage, sha256)

    assert got.run_key == job.run_key and got.config.storage.local_dir == str(tmp_path / "machine-b")
    assert Path(got.dataset_dir).name == Path(job.dataset_dir).name and got.dataset_dir.startswith(str(tmp_path / "machine-b"))
    assert (Path(got.dataset_dir) / "manifest.json").exists() and Path(got.stats_path).exists()
    writes = [(method, path) for method, path, _ in fault_proxy.requests if method in ("PUT", "POST", "DELETE")]
    assert fault_proxy.requests and writes == []


def test_a_node_refuses_a_frozen_job_of_another_run(demo_source: Path, tmp_path: Path) -> None:
    config = load_config(overrides=small_overrides(tmp_path / "root", demo_source) + ["train.distributed.nnodes=2"])
    job = make_job(config)
    rel, sha256 = publish_frozen_job(job)
    with pytest.raises(ConfigError, match=f"holds run {job.run_key[:12]}, not run {'0' * 12} this node was started for"):
        node_job("0" * 16, rel, config.storage, sha256)


def _tampered(job: TrainJob, field: str, root: Path) -> None:
    """A field the node reads, set to what an attacker with write access to the root would."""
    cfg = job.config
    if field == "stats_path":  # another run's statistics: the same key would train differently
        job.stats_path = str(root / "preprocess" / "other" / "feature_stats.json")
    elif field == "pause_at":
        job.pause_at = 5
    elif field == "new_segments":
        job.new_segments = ["f" * 64]
    elif field == "champion_val_metric":
        job.champion_val_metric = 0.999
    elif field == "rate_per_hour":
        job.rate_per_hour = 1e6
    elif field == "data.numeric":
        cfg.data.numeric = cfg.data.numeric[:1]
    elif field == "data.source":
        cfg.data.source = str(root / "elsewhere.parquet")
    elif field == "budget":
        cfg.budget.max_usd = 1e9
    elif field == "spot_notice_url":
        cfg.train.checkpoint.spot_notice_url = "http://127.0.0.1:9/latest/meta-data/spot/instance-action"
    elif field == "lr":
        cfg.train.optim.lr *= 10
    elif field == "run_dir":
        job.run_dir = str(root.parent / "outside")


@pytest.mark.parametrize("field", ["stats_path", "pause_at", "new_segments", "champion_val_metric", "rate_per_hour",
                                   "data.numeric", "data.source", "budget", "spot_notice_url", "lr", "run_dir"])
def test_a_node_refuses_a_frozen_job_changed_on_the_root(field: str, demo_source: Path, tmp_path: Path) -> None:
    """The root is writable by others: a frozen job rewritten there, in any field (keyed or
    not), is not the bytes the launcher sealed, and no node trains it. The node's digest
    comes from its command line, which TorchX's app sets, never from the root."""
    config = load_config(overrides=small_overrides(tmp_path / "root", demo_source) + ["train.distributed.nnodes=2"])
    job = make_job(config)
    rel, sha256 = publish_frozen_job(job)
    assert node_job(job.run_key, rel, config.storage, sha256).run_key == job.run_key

    path = Path(config.storage.root) / rel
    frozen = json.loads(path.read_text())
    planted = TrainJob(**{**{k: v for k, v in frozen["job"].items() if k != "config"},
                          "config": config.model_validate(frozen["job"]["config"])})
    _tampered(planted, field, Path(config.storage.root))
    frozen["job"] = planted.to_json()
    path.write_text(json.dumps(frozen))
    with pytest.raises(StorageError, match="changed after the parent wrote it"):
        node_job(job.run_key, rel, config.storage, sha256)


def test_a_node_still_refuses_settings_that_do_not_make_its_run_key(demo_source: Path, tmp_path: Path) -> None:
    """Behind the seal, the key: a job whose settings are not what its key was made of is
    refused even with a digest that matches (a launcher of another version, say)."""
    config = load_config(overrides=small_overrides(tmp_path / "root", demo_source) + ["train.distributed.nnodes=2"])
    job = make_job(config)
    job.config.train.optim.lr *= 10  # after the key was computed
    rel, sha256 = publish_frozen_job(job)
    with pytest.raises(ConfigError, match="does not hold what run .* computes"):
        node_job(job.run_key, rel, config.storage, sha256)
