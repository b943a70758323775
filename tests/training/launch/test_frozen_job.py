"""A node of a multi-node job reads the frozen job its train task published, and nothing else
decides what it trains: not the source, not its own config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import s3_overrides, small_overrides
from tests.training.helpers import make_job
from training.config import StorageConfig, load_config
from training.errors import ConfigError
from training.launch.group import publish_frozen_job
from training.worker.node import node_job


def test_a_fresh_node_brings_down_the_frozen_jobs_data_and_writes_nothing_to_the_root(
        s3_bucket: str, s3_server: str, fault_proxy, demo_source: Path, tmp_path: Path) -> None:
    """Another machine (its own empty working copy) reaches S3 through a proxy that logs every
    request: it finds the job's dataset, segments and statistics, at its own paths, and not one
    request writes."""
    config = load_config(overrides=small_overrides(tmp_path / "unused", demo_source)
                         + s3_overrides(s3_bucket, s3_server, tmp_path / "machine-a") + ["train.distributed.nnodes=2"])
    job = make_job(config)
    rel = publish_frozen_job(job)
    storage = StorageConfig.model_validate({**config.storage.model_dump(), "endpoint_url": fault_proxy.url,
                                            "local_dir": str(tmp_path / "machine-b")})

    got = node_job(job.run_key, rel, storage)

    assert got.run_key == job.run_key and got.config.storage.local_dir == str(tmp_path / "machine-b")
    assert Path(got.dataset_dir).name == Path(job.dataset_dir).name and got.dataset_dir.startswith(str(tmp_path / "machine-b"))
    assert (Path(got.dataset_dir) / "manifest.json").exists() and Path(got.stats_path).exists()
    writes = [(method, path) for method, path, _ in fault_proxy.requests if method in ("PUT", "POST", "DELETE")]
    assert fault_proxy.requests and writes == []


def test_a_node_refuses_a_frozen_job_of_another_run(demo_source: Path, tmp_path: Path) -> None:
    config = load_config(overrides=small_overrides(tmp_path / "root", demo_source) + ["train.distributed.nnodes=2"])
    job = make_job(config)
    rel = publish_frozen_job(job)
    with pytest.raises(ConfigError, match=f"holds run {job.run_key[:12]}, not run {'0' * 12} this node was started for"):
        node_job("0" * 16, rel, config.storage)

    path = Path(config.storage.root) / rel
    frozen = json.loads(path.read_text())
    frozen["job"]["run_key"] = "f" * 16  # the file changed under its name: still refused
    path.write_text(json.dumps(frozen))
    with pytest.raises(ConfigError, match="holds run ffffffffffff"):
        node_job(job.run_key, rel, config.storage)
    path.write_text('{"run_key": 1}')
    with pytest.raises(ConfigError, match=r"node-job.json is not a frozen training job"):
        node_job(job.run_key, rel, config.storage)


def test_a_node_refuses_a_frozen_job_whose_settings_changed_under_its_run_key(demo_source: Path, tmp_path: Path) -> None:
    """The root is writable by others: a frozen job edited in place (another learning rate,
    the same run key) is not what the key was made of, and no node trains it."""
    config = load_config(overrides=small_overrides(tmp_path / "root", demo_source) + ["train.distributed.nnodes=2"])
    job = make_job(config)
    rel = publish_frozen_job(job)
    assert node_job(job.run_key, rel, config.storage).run_key == job.run_key

    path = Path(config.storage.root) / rel
    frozen = json.loads(path.read_text())
    frozen["job"]["config"]["train"]["optim"]["lr"] *= 10
    path.write_text(json.dumps(frozen))
    with pytest.raises(ConfigError, match="does not hold what run .* computes"):
        node_job(job.run_key, rel, config.storage)
