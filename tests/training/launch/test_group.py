"""Several nodes started by TorchX from one frozen job: real torchrun agents on this machine
(TorchX's local_cwd scheduler, one process tree per node), gloo on loopback, torchrun's c10d
rendezvous under the run key."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from tests.conftest import small_overrides
from tests.kill import kill_node_when
from tests.training.helpers import make_job
from training.config import load_config
from training.errors import Preempted
from training.protocol.events import ChildEvent
from training.launch.group import run_group
from training.launch.process import run_training_process

pytestmark = pytest.mark.slow

WEIGHT_TOLERANCE = 1e-4  # the same global batches; only the order of float additions differs
DATA = ["data.segment_rows=6000", "data.shard_size_mb=0.07", "train.checkpoint.every=10"]


def _config(root: Path, source: Path, *extra: str):
    return load_config(overrides=small_overrides(root, source) + [*DATA, *extra])


def _weights(result) -> dict[str, torch.Tensor]:
    return torch.load(result.model.uri, weights_only=True)


def _gap(a, b) -> float:
    w1, w2 = _weights(a), _weights(b)
    assert set(w1) == set(w2)
    return max((w1[k].double() - w2[k].double()).abs().max().item() for k in w1)


def test_two_nodes_train_the_one_node_model_and_a_file_added_meanwhile_changes_nothing(
        demo_source: Path, tmp_path: Path) -> None:
    """The train task freezes its job, then a file lands in the source before the nodes start:
    they train the frozen job (they never list the source), so the model is the one-process
    model, to float order. A node that built its job from the source it listed would train
    other data under the same run."""
    source = tmp_path / "source"
    source.mkdir()
    shutil.copy(demo_source, source / "a.parquet")
    reference = run_training_process(make_job(_config(tmp_path / "one", source)))  # one process
    job = make_job(_config(tmp_path / "nodes", source, "train.distributed.nnodes=2"))
    pq.write_table(pq.read_table(demo_source).slice(0, 3000), source / "b.parquet")

    events: list[ChildEvent] = []
    result = run_group(job, on_event=events.append)

    assert result.world_size == 2 and result.steps == 60
    assert {e.rank for e in events if e.event == "rank_done"} == {0, 1}  # both nodes' ranks reported here
    assert _gap(reference, result) < WEIGHT_TOLERANCE
    assert not list(Path(job.run_dir).glob("nodes/*/node/*/error*"))


def test_a_lost_node_ends_the_attempt_and_the_retry_starts_every_node_and_resumes(demo_source: Path,
                                                                                  tmp_path: Path) -> None:
    """Node 1 (its torchrun agent and its rank) is killed at step 25. Node 0's agent restarts its
    rank and waits at the rendezvous for a node that never comes, up to join_timeout_s; the
    attempt ends as a preemption and every node is stopped. The retry starts both nodes again,
    and they resume from the last checkpoint to the uninterrupted model."""
    reference = run_training_process(make_job(_config(tmp_path / "one", demo_source, "train.distributed.nproc_per_node=2")))
    job = make_job(_config(tmp_path / "nodes", demo_source, "train.distributed.nnodes=2",
                           "train.distributed.join_timeout_s=10", "train.distributed.max_restarts=1"))
    kill_node_when(job.run_dir, 25, node=1)
    with pytest.raises(Preempted, match="lost a node"):
        run_group(job)

    events: list[ChildEvent] = []
    result = run_group(job, on_event=events.append)  # what the task's retry does
    resumed = [e.step for e in events if e.event == "resumed"]
    assert resumed and 20 <= resumed[0] < result.steps
    assert result.steps == 60 and _gap(reference, result) < WEIGHT_TOLERANCE


def test_a_ranks_own_error_on_any_node_is_raised_in_the_flow_and_stops_every_node(demo_source: Path,
                                                                                  tmp_path: Path) -> None:
    """The job was keyed for bf16 on CUDA (as for GPU nodes on Kubernetes); these nodes resolve
    fp32 on CPU, so every rank refuses to train another run under that key. The flow gets the
    ranks' own ConfigError from their output, not a lost node, and stops the group at once
    instead of waiting out the rendezvous (join_timeout_s is the default 900 s here)."""
    from training.errors import ConfigError

    from training.pipeline.train_stage import run_key_for

    job = make_job(_config(tmp_path / "nodes", demo_source, "train.distributed.nnodes=2"))
    job.numerics = ["cuda", "bf16"]
    job.run_key = run_key_for(job.config, Path(job.dataset_dir).name, None, ("cuda", "bf16"))
    job.run_dir = str(Path(job.run_dir).parent / job.run_key)
    with pytest.raises(ConfigError, match="was keyed for bf16 on cuda, but this machine resolves"):
        run_group(job)
    assert not list(Path(job.run_dir).glob("checkpoints/step-*"))


def _stop_node_at_start(run_dir: str, node: int) -> threading.Thread:
    """SIGSTOP node `node` as soon as its process has said where it is (its pid file), before it
    reaches the rendezvous: a node that hangs instead of dying."""
    def watch() -> None:
        deadline = time.time() + 120
        while time.time() < deadline:
            for pid_file in Path(run_dir).glob(f"nodes/*/node-{node}.pid"):
                with contextlib.suppress(OSError, ValueError):
                    os.kill(int(pid_file.read_text()), signal.SIGSTOP)
                    return
            time.sleep(0.005)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_stopped_node_ends_the_attempt_within_the_join_timeout_with_one_line(demo_source: Path,
                                                                             tmp_path: Path) -> None:
    """Node 1 is stopped before it joins: its process lives, so TorchX calls the app running,
    and without a deadline of its own the attempt would hang. It ends once node 0's rendezvous
    gives up (the join timeout), as a lost node with one line naming node 1, and the stopped
    node is killed, with no node folder left behind."""
    job = make_job(_config(tmp_path / "nodes", demo_source, "train.distributed.nnodes=2",
                           "train.distributed.join_timeout_s=10"))
    _stop_node_at_start(job.run_dir, 1)
    events: list[ChildEvent] = []
    started = time.monotonic()
    with pytest.raises(Preempted, match=r"lost a node: .*nodes? (0, )?1\b") as err:
        run_group(job, on_event=events.append)
    assert time.monotonic() - started < 10 + 60 + 30  # the join timeout, the nodes' start-up, the teardown
    assert "\n" not in str(err.value)
    lines = [e.message for e in events if e.event == "log"]
    assert not any("node 1 is in the group" in line for line in lines)  # counted only once torchrun admits it
    assert not list(Path(tempfile.gettempdir()).glob(f"retrain-node-*-{job.run_key[:4]}*"))
    pids = [int(p.read_text()) for p in Path(job.run_dir).glob("nodes/*/node-*.pid")]
    assert pids and not any(Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text()
                            .rsplit(") ", 1)[-1][:1] for pid in pids)
    assert not [h for h in Path(job.run_dir).glob("nodes/*/node-*.home") if Path(h.read_text()).exists()]


def test_min_max_trains_with_the_nodes_that_came_and_reports_the_run_complete(demo_source: Path,
                                                                            tmp_path: Path) -> None:
    """Three nodes, at least two, a short join timeout: node 2 is stopped before it joins. The
    last call (a quarter of the join timeout here, not torchrun's fixed 30 s) lets the two that
    came train; the run is complete, not a lost node, and the stopped node is killed."""
    job = make_job(_config(tmp_path / "nodes", demo_source, "train.distributed.nnodes=3",
                           "train.distributed.min_nnodes=2", "train.batch_size=132",
                           "train.distributed.join_timeout_s=20"))
    _stop_node_at_start(job.run_dir, 2)
    events: list[ChildEvent] = []
    result = run_group(job, on_event=events.append)
    assert result.steps == 60 and result.world_size == 2
    lines = [e.message for e in events if e.event == "log"]
    assert sum("is in the group" in line for line in lines) == 2
