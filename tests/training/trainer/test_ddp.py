"""Data-parallel training under torchrun: two CPU processes, gloo, on loopback only."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from retrain_cli.temp_server import free_port
from tests.conftest import small_overrides
from tests.kill import kill_worker_when
from tests.training.helpers import make_job
from training.launch.events import ChildEvent
from training.config import load_config
from training.errors import Preempted
from training.launch.process import run_training_process

pytestmark = pytest.mark.slow

# Same global batch (128 rows) on 1 and 2 processes: the same rows per step, gradients averaged
# over the same 128 rows; only the order of float additions differs (all-reduce of two halves).
WEIGHT_TOLERANCE = 1e-4
AUC_TOLERANCE = 1e-4


# Two segments of 6000 and 2000 rows, 9 train shards in all: the odd count the first test needs.
DATA = ["data.segment_rows=6000", "data.shard_size_mb=0.07"]


def _config(root: Path, source: Path, *extra: str):
    return load_config(overrides=small_overrides(root, source) + ["train.checkpoint.every=10", *DATA, *extra])


def _weights(result: dict) -> dict[str, torch.Tensor]:
    return torch.load(result.model.uri, weights_only=True)


def test_two_ranks_match_one_process_and_see_equal_samples(demo_source: Path, tmp_path: Path) -> None:
    """Also the uneven case: the train split has an odd number of shards, so the ranks cannot
    split shards evenly, and the run crosses an epoch boundary; nobody hangs or runs short."""
    one = run_training_process(make_job(_config(tmp_path / "one", demo_source)))
    events: list[ChildEvent] = []
    job = make_job(_config(tmp_path / "two", demo_source, "train.distributed.nproc_per_node=2"))
    from training.data.manifest import load_manifest

    train_shards = load_manifest(Path(job.dataset_dir)).shards_of("train")
    assert len(train_shards) % 2 == 1, len(train_shards)
    two = run_training_process(job, on_event=events.append)

    assert two.world_size == 2 and two.steps == one.steps == 60
    done = {e.rank: e for e in events if e.event == "rank_done"}
    assert set(done) == {0, 1}
    assert done[0].rows == done[1].rows == 60 * 64  # 64 rows per rank per step, every step
    rows_per_epoch = sum(s.rows for s in train_shards)
    assert 60 * 128 > rows_per_epoch  # crossed into the second epoch
    for a, b in zip(one.history, two.history, strict=True):
        assert a.step == b.step
        assert abs(a["auc"] - b["auc"]) < AUC_TOLERANCE
        assert abs(a.train_loss - b.train_loss) < 1e-4
    w1, w2 = _weights(one), _weights(two)
    assert set(w1) == set(w2)  # DDP's "module." prefix never reaches the package
    assert max((w1[k].double() - w2[k].double()).abs().max().item() for k in w1) < WEIGHT_TOLERANCE


def test_killed_rank_fails_the_job_fast_and_the_retry_resumes_bit_identical(demo_source: Path, tmp_path: Path) -> None:
    reference = run_training_process(make_job(_config(tmp_path / "reference", demo_source, "train.distributed.nproc_per_node=2")))

    job = make_job(_config(tmp_path / "killed", demo_source, "train.distributed.nproc_per_node=2"))
    kill_worker_when(job.run_dir, 25, signal.SIGKILL, rank=1)
    with pytest.raises(Preempted, match="lost a rank"):
        run_training_process(job)  # rank 0 must not hang on its dead peer: pytest's timeout guards that

    events: list[ChildEvent] = []
    result = run_training_process(job, on_event=events.append)  # what the task retry does
    resumed = [e.step for e in events if e.event == "resumed"]
    # The killer polls from outside; beside another busy process it has landed after step 30's
    # checkpoint (one clean-clone CI run), so any checkpoint from the kill's step on counts.
    assert resumed and 20 <= resumed[0] < result.steps
    assert result.model.sha256 == reference.model.sha256


def test_sigterm_to_one_rank_gives_one_consistent_emergency_checkpoint(demo_source: Path, tmp_path: Path) -> None:
    reference = run_training_process(make_job(_config(tmp_path / "reference", demo_source, "train.distributed.nproc_per_node=2",
                                                      "train.checkpoint.every=1000")))
    job = make_job(_config(tmp_path / "term", demo_source, "train.distributed.nproc_per_node=2", "train.checkpoint.every=1000"))
    kill_worker_when(job.run_dir, 33, signal.SIGTERM, rank=1)
    with pytest.raises(Preempted):
        run_training_process(job)
    from training.trainer.checkpoint import latest_verified_checkpoint

    path, manifest = latest_verified_checkpoint(Path(job.run_dir) / "checkpoints")
    assert manifest.emergency and manifest.step >= 33  # both ranks stopped at the step they agreed on
    events: list[ChildEvent] = []
    result = run_training_process(job, on_event=events.append)
    assert [e.step for e in events if e.event == "resumed"] == [manifest.step]
    assert result.model.sha256 == reference.model.sha256


def test_resume_on_another_world_size_continues_the_same_batches(demo_source: Path, tmp_path: Path) -> None:
    """Checkpoint on 2 processes, resume on 1: the position is in global batches, so the run
    goes on with the next global batch and ends where a 2-process run ends, within tolerance."""
    reference = run_training_process(make_job(_config(tmp_path / "reference", demo_source, "train.distributed.nproc_per_node=2")))
    job = make_job(_config(tmp_path / "switch", demo_source, "train.distributed.nproc_per_node=2"))
    kill_worker_when(job.run_dir, 25, signal.SIGKILL, rank=1)
    with pytest.raises(Preempted):
        run_training_process(job)
    job.config.train.distributed.nproc_per_node = 1  # the retry lands on a smaller machine
    events: list[ChildEvent] = []
    result = run_training_process(job, on_event=events.append)
    assert [e for e in events if e.event == "resumed"]
    assert result.world_size == 1 and result.steps == 60
    w1, w2 = _weights(reference), _weights(result)
    assert max((w1[k].double() - w2[k].double()).abs().max().item() for k in w1) < WEIGHT_TOLERANCE


def test_two_nodes_on_loopback_train_as_one_two_process_job(demo_source: Path, tmp_path: Path, monkeypatch) -> None:
    """nnodes=2: this process launches node 0 as the train task does; `retrain join
    --node-rank 1` (a second process, as on a second machine) joins through the rendezvous."""
    import os
    import subprocess
    import sys

    port = free_port()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    reference = run_training_process(make_job(_config(tmp_path / "reference", demo_source, "train.distributed.nproc_per_node=2")))
    overrides = small_overrides(tmp_path / "nodes", demo_source) + DATA + [
        "train.checkpoint.every=10", "train.distributed.nnodes=2", f"train.distributed.rdzv_endpoint=127.0.0.1:{port}"]
    job = make_job(load_config(overrides=overrides))
    args = [sys.executable, "-m", "retrain_cli.main", "join", "--node-rank", "1"]
    for o in overrides:
        args += ["--set", o]
    node1 = subprocess.Popen(args, env={**os.environ}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        result = run_training_process(job)
        out, _ = node1.communicate(timeout=120)
    finally:
        if node1.poll() is None:
            node1.kill()
    assert node1.returncode == 0, out[-3000:]
    assert result.world_size == 2 and result.steps == 60
    w1, w2 = _weights(reference), _weights(result)
    assert max((w1[k].double() - w2[k].double()).abs().max().item() for k in w1) < WEIGHT_TOLERANCE


def test_a_node_that_joins_with_another_job_is_refused_on_every_node(demo_source: Path, tmp_path: Path,
                                                                   monkeypatch) -> None:
    """Node 1 started with another learning rate: the same shapes, so DDP's own checks pass and
    the two nodes would step one model with different settings. Every node refuses instead, and
    the flow's node says which rank differs."""
    import os
    import subprocess
    import sys

    from training.errors import EXIT_USER_ERROR, ConfigError

    port = free_port()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    overrides = small_overrides(tmp_path / "nodes", demo_source) + DATA + [
        "train.distributed.nnodes=2", f"train.distributed.rdzv_endpoint=127.0.0.1:{port}"]
    args = [sys.executable, "-m", "retrain_cli.main", "join", "--node-rank", "1"]
    for o in [*overrides, "train.optim.lr=0.001"]:
        args += ["--set", o]
    node1 = subprocess.Popen(args, env={**os.environ}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with pytest.raises(ConfigError, match="rank 1 joined with another job than rank 0's"):
            run_training_process(make_job(load_config(overrides=overrides)))
        out, _ = node1.communicate(timeout=120)
    finally:
        if node1.poll() is None:
            node1.kill()
    assert node1.returncode == EXIT_USER_ERROR, out[-3000:]
    assert out.strip().splitlines()[-1].startswith("retrain: error: rank 1 joined with another job") and not list((tmp_path / "nodes").rglob("step-*"))


def test_node_0_waits_for_the_other_nodes_no_longer_than_join_timeout(demo_source: Path, tmp_path: Path,
                                                                      monkeypatch, caplog) -> None:
    """Nobody joins: node 0 says where it waits and for whom, and gives up after
    train.distributed.join_timeout_s (torchrun's own default is 600 s), as a preemption."""
    import logging

    port = free_port()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    config = load_config(overrides=small_overrides(tmp_path / "alone", demo_source) + [
        "train.distributed.nnodes=2", f"train.distributed.rdzv_endpoint=127.0.0.1:{port}",
        "train.distributed.join_timeout_s=10"])
    with caplog.at_level(logging.INFO, logger="training.launch.process"), pytest.raises(Preempted, match="lost a rank"):
        run_training_process(make_job(config))
    assert f"waiting up to 10 s at 127.0.0.1:{port} for node(s) 1" in caplog.text


def test_a_joining_node_waits_for_node_0s_data_and_writes_nothing_to_the_root(
        s3_bucket: str, s3_server: str, fault_proxy, demo_source: Path, tmp_path: Path, monkeypatch) -> None:
    """Node 1 starts first, on an S3 root where nothing is packed yet: it waits for node 0's
    dataset and statistics instead of packing and fitting them itself, then trains with node 0.
    It reaches S3 through a proxy that logs every request: not one of them writes."""
    import os
    import subprocess
    import sys
    import threading
    import time

    from tests.conftest import s3_overrides

    port = free_port()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    common = small_overrides(tmp_path / "unused", demo_source) + DATA + [
        "train.checkpoint.every=10", "train.distributed.nnodes=2", f"train.distributed.rdzv_endpoint=127.0.0.1:{port}"]
    args = [sys.executable, "-m", "retrain_cli.main", "join", "--node-rank", "1"]
    for o in [*common, *s3_overrides(s3_bucket, fault_proxy.url, tmp_path / "node-1")]:
        args += ["--set", o]
    node1 = subprocess.Popen(args, env={**os.environ}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(node1.stdout.readline, "")), daemon=True).start()
    try:
        deadline = time.monotonic() + 120
        while not any("waiting for node 0" in line for line in lines) and node1.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert any("not packed yet" in line for line in lines), "".join(lines)[-3000:]
        job = make_job(load_config(overrides=common + s3_overrides(s3_bucket, s3_server, tmp_path / "node-0")))
        result = run_training_process(job)
        node1.wait(timeout=120)
    finally:
        if node1.poll() is None:
            node1.kill()
    assert node1.returncode == 0, "".join(lines)[-3000:]
    assert result.world_size == 2 and result.steps == 60
    writes = [(method, path) for method, path, _ in fault_proxy.requests if method in ("PUT", "POST", "DELETE")]
    assert fault_proxy.requests and writes == []


def test_two_ranks_on_s3_resume_on_a_fresh_machine(s3_bucket: str, s3_server: str, demo_source: Path,
                                                    tmp_path: Path) -> None:
    """Rank 0 uploads the checkpoints; after a rank dies, a new machine (empty local dir)
    downloads the newest one once per node and both ranks resume from it."""
    from tests.conftest import s3_overrides

    # 300 steps: the killer must find rank 1 (a scan of /proc) while it still trains; at 60 steps
    # the run finished first once in five clean-clone CI runs here.
    reference = run_training_process(make_job(_config(tmp_path / "reference", demo_source, "train.distributed.nproc_per_node=2",
                                                      "train.max_steps=300")))
    overrides = small_overrides(tmp_path / "unused", demo_source) + DATA + s3_overrides(
        s3_bucket, s3_server, tmp_path / "machine-a") + ["train.checkpoint.every=10", "train.distributed.nproc_per_node=2",
                                                         "train.max_steps=300"]
    job = make_job(load_config(overrides=overrides))
    kill_worker_when(job.run_dir, 25, signal.SIGKILL, rank=1)
    with pytest.raises(Preempted):
        run_training_process(job)
    job_b = make_job(load_config(overrides=overrides + [f"storage.local_dir={tmp_path / 'machine-b'}"]))
    events: list[ChildEvent] = []
    result = run_training_process(job_b, on_event=events.append)
    resumed = [e.step for e in events if e.event == "resumed"]
    assert resumed and 10 <= resumed[0] < result.steps  # uploads lag: an earlier checkpoint may be the newest
    assert result.model.sha256 == reference.model.sha256
