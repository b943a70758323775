"""The thread policy: `train.torch_threads` from the CPUs the process may use, minus its loader."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.training.helpers import make_job
from training.config import RetrainConfig
from training.loop import train
from training.threads import cgroup_quota, decide_threads

AFFINITY = len(os.sched_getaffinity(0))


def testcgroup_quota_is_read_from_v2_then_v1(tmp_path: Path) -> None:
    v2, q1, p1 = tmp_path / "cpu.max", tmp_path / "quota", tmp_path / "period"
    v2.write_text("150000 100000\n")
    assert cgroup_quota(v2, (q1, p1)) == 1.5
    v2.write_text("max 100000\n")
    assert cgroup_quota(v2, (q1, p1)) is None
    v2.unlink()
    q1.write_text("300000\n"), p1.write_text("100000\n")
    assert cgroup_quota(v2, (q1, p1)) == 3.0
    q1.write_text("-1\n")
    assert cgroup_quota(v2, (q1, p1)) is None


@pytest.mark.parametrize(("quota", "workers", "per_node", "expected"), [
    (None, 0, 1, 7),   # 8 cores: one for the prefetch thread
    (None, 3, 1, 5),   # one per worker process
    (None, 0, 2, 3),   # two ranks share the node
    (2.5, 0, 1, 1),    # a fractional quota rounds down
    (1.0, 0, 1, 1),    # never below one
])
def test_auto_shares_the_usable_cpus(monkeypatch: pytest.MonkeyPatch, quota: float | None, workers: int,
                                     per_node: int, expected: int) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    policy = decide_threads("auto", workers, per_node, quota=quota)
    assert policy.threads == expected
    assert policy.usable_cpus == (8.0 if quota is None else quota)


def test_a_quota_below_the_affinity_mask_wins() -> None:
    policy = decide_threads("auto", 0, quota=1.0)
    assert policy.usable_cpus == 1.0 and policy.cpu_quota == 1.0 and policy.threads == 1


def test_a_number_is_taken_as_given() -> None:
    assert decide_threads(3, 0, quota=1.0).threads == 3


def test_the_run_sets_and_reports_its_threads(small_config: RetrainConfig) -> None:
    small_config.train.num_workers = 0
    result = train(make_job(small_config, "threads-auto"))
    assert result.threads is not None and result.threads.setting == "auto"
    assert result.threads.threads == max(1, AFFINITY - 1) == torch.get_num_threads()
    small_config.train.torch_threads = 2
    pinned = train(make_job(small_config, "threads-2"))
    assert pinned.threads is not None and pinned.threads.threads == 2 == torch.get_num_threads()
    assert pinned.model.sha256 == result.model.sha256  # the thread count changes speed only
