"""The thread policy: `train.loader.torch_threads` from the CPUs the process may use, less what other
processes keep busy and what its loader needs."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from tests.training.helpers import make_job
from training.config import RetrainConfig
from training.trainer.run import train
from training.protocol.threads import (LOADER_BUSY_FOR_A_CORE, CpuClock, apply_thread_policy, cgroup_quota,
                                      decide_threads)

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


@pytest.mark.parametrize(("quota", "workers", "per_node", "others", "loader", "expected"), [
    (None, 0, 1, 0.0, None, 7),   # 8 cores: one for a prefetch thread not measured
    (None, 0, 1, 0.0, 0.02, 8),   # a prefetch thread busy 2 % of a step keeps no core
    (None, 0, 1, 0.0, 0.8, 7),    # one busy most of a step does
    (None, 3, 1, 0.0, None, 5),   # one per worker process
    (None, 0, 2, 0.0, None, 3),   # two ranks share the node
    (None, 0, 1, 3.0, 0.02, 5),   # 3 cores busy elsewhere
    (None, 0, 1, 0.3, 0.02, 8),   # under half a core elsewhere is noise
    (None, 0, 2, 3.0, 0.02, 4),   # ranks: each other's start-up is not outside load
    (2.5, 0, 1, 0.0, None, 1),    # a fractional quota rounds down
    (1.0, 0, 1, 0.0, None, 1),    # never below one
    (None, 0, 1, 8.0, 0.02, 1),   # nor on a saturated machine
])
def test_auto_shares_the_usable_cpus(monkeypatch: pytest.MonkeyPatch, quota: float | None, workers: int,
                                     per_node: int, others: float, loader: float | None, expected: int) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    policy = decide_threads("auto", workers, per_node, quota=quota, others_busy=others, loader_busy=loader)
    assert policy.threads == expected
    assert policy.usable_cpus == (8.0 if quota is None else quota)


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _others_over(seconds: float, work: Callable[[float], None]) -> float:
    start = CpuClock.read()
    work(seconds)
    return CpuClock.read().others_busy_since(start)


def _cpu_seconds(pid: int) -> float:
    """A process's user + system CPU seconds, from /proc (what the kernel charged it)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_the_clock_counts_other_processes_not_this_one() -> None:
    """Two readings: the machine's busy CPU time less this process's own, per wall second."""
    tick = os.sysconf("SC_CLK_TCK")
    earlier = CpuClock(wall=100.0, busy_ticks=1000, own_seconds=5.0)
    alone = CpuClock(wall=102.0, busy_ticks=1000 + 2 * tick, own_seconds=7.0)  # all of it this process's
    assert alone.others_busy_since(earlier) == 0.0
    shared = CpuClock(wall=102.0, busy_ticks=1000 + 3 * tick, own_seconds=6.0)  # 1 s ours, 2 s theirs
    assert shared.others_busy_since(earlier) == pytest.approx(1.0)
    assert CpuClock(102.0, None, 6.0).others_busy_since(earlier) == 0.0  # unknown: counted as none


def test_a_real_burner_is_counted() -> None:
    """Against the kernel, whatever else loads the machine: the clock's reading of other
    processes over a window holds at least what the kernel charged a burner over that window."""
    burner = multiprocessing.get_context("spawn").Process(target=_spin, args=(60.0,), daemon=True)
    burner.start()
    try:
        assert burner.pid is not None
        deadline = time.monotonic() + 30
        while _cpu_seconds(burner.pid) < 0.05 and time.monotonic() < deadline:  # past its interpreter start-up
            time.sleep(0.05)
        used, t0 = _cpu_seconds(burner.pid), time.monotonic()
        burned = _others_over(0.6, time.sleep)
        share = (_cpu_seconds(burner.pid) - used) / (time.monotonic() - t0)
    finally:
        burner.kill()
        burner.join()
    # Everything the burner ran is counted (less the kernel's 10 ms tick granularity).
    assert share > 0 and burned > share - 0.15, (burned, share)


def test_a_resume_keeps_the_first_attempts_count_unless_set() -> None:
    kept = apply_thread_policy("auto", 0, kept=1)
    assert kept.threads == 1 == torch.get_num_threads() and kept.kept_from_checkpoint
    assert apply_thread_policy(2, 0, kept=1).threads == 2 == torch.get_num_threads()


def test_a_quota_below_the_affinity_mask_wins() -> None:
    policy = decide_threads("auto", 0, quota=1.0)
    assert policy.usable_cpus == 1.0 and policy.cpu_quota == 1.0 and policy.threads == 1


def test_a_number_is_taken_as_given() -> None:
    assert decide_threads(3, 0, quota=1.0).threads == 3


def test_the_run_sets_and_reports_its_threads(small_config: RetrainConfig) -> None:
    """The run measures its prefetch thread's share of a step and the other processes' load, and
    sets and reports the count `decide_threads` gives for those figures. (The figures themselves
    depend on the machine's load, so the test checks the decision made from them.)"""
    small_config.train.loader.torch_threads = "auto"
    result = train(make_job(small_config, "threads-auto"))
    policy = result.threads
    assert policy is not None and policy.setting == "auto" and result.num_workers.used == 0
    assert policy.loader_busy is not None and policy.loader_busy > 0
    assert policy.reserved == (1 if policy.loader_busy >= LOADER_BUSY_FOR_A_CORE else 0)
    assert policy.threads == decide_threads("auto", 0, others_busy=policy.others_busy,
                                            loader_busy=policy.loader_busy).threads
    assert policy.threads == torch.get_num_threads()
    small_config.train.loader.torch_threads = 1
    pinned = train(make_job(small_config, "threads-1"))
    assert pinned.threads is not None and pinned.threads.threads == 1 == torch.get_num_threads()
    assert pinned.model.sha256 == result.model.sha256  # the thread count changes speed only
