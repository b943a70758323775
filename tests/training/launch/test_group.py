"""Several nodes started by TorchX from one frozen job: real torchrun agents on this machine
(TorchX's local_cwd scheduler, one process tree per node), gloo on loopback, torchrun's c10d
rendezvous under the run key."""

from __future__ import annotations

import shutil
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
