"""Data-parallel training under torchrun: two CPU processes, gloo, on loopback only."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from tests.conftest import small_overrides
from tests.kill import kill_worker_when
from tests.training.helpers import make_job
from training.protocol.events import ChildEvent
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
    # Blocks of 5 steps: a stop lands at a block's end, so with auto's blocks (20 steps on a quiet
    # machine) a signal after step 40 would be heard only at the run's end, step 60.
    job = make_job(_config(tmp_path / "term", demo_source, "train.distributed.nproc_per_node=2", "train.checkpoint.every=1000",
                           "train.steps_per_block=5"))
    kill_worker_when(job.run_dir, 33, signal.SIGTERM, rank=1)
    with pytest.raises(Preempted):
        run_training_process(job)
    from training.trainer.checkpoint import latest_verified_checkpoint

    path, manifest = latest_verified_checkpoint(Path(job.run_dir) / "checkpoints")
    # Both ranks stopped at the block's end they agreed on.
    assert manifest.emergency and manifest.step >= 33 and manifest.step % 5 == 0
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
