"""A tuning study's warm training children: a job run in a child that already ran others is
the job run in a fresh child, and the pool never keeps a child that failed or was told to go."""

from __future__ import annotations

import os
import signal

import pytest

from training.launch.child import WarmPool
from training.config import RetrainConfig
from training.errors import ConfigError
from training.launch.process import run_rung_process, run_training_process
from training.protocol.results import RungResult

from tests.training.helpers import make_job


def _pid(pool: WarmPool) -> int:
    child = pool.take()
    assert child is not None, "no warm child was kept"
    pool.give(child)
    return child.proc.pid


def test_runs_in_one_warm_child_end_as_in_fresh_children(small_config: RetrainConfig) -> None:
    reference = run_training_process(make_job(small_config, "reference"))
    other = small_config.model_copy(deep=True)
    other.train.optim.lr = small_config.train.optim.lr / 3
    other_reference = run_training_process(make_job(other, "other-reference"))
    pool = WarmPool(size=1)
    try:
        job, other_job = make_job(small_config, "warm"), make_job(other, "other-warm")
        job.pause_at = 20
        first = run_rung_process(job, pool=pool)
        assert isinstance(first, RungResult) and (first.status, first.step) == ("paused", 20)
        pid = _pid(pool)
        # Another run in between, in the same child, then the first goes on from its rung.
        assert run_training_process(other_job, pool=pool).model.sha256 == other_reference.model.sha256
        job.pause_at = 40
        assert run_rung_process(job, pool=pool).step == 40
        job.pause_at = None
        final = run_training_process(job, pool=pool)
        assert _pid(pool) == pid, "the jobs did not share one warm child"
    finally:
        pool.close()
    assert final.model.sha256 == reference.model.sha256 and final.history == reference.history
    # Warm jobs are neither preemptions nor extra process start-ups of the run.
    assert final.preemptions == 0 and final.resumed_from_steps == [20, 40]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # closed with the pool


def test_a_child_that_failed_or_died_is_not_reused(small_config: RetrainConfig) -> None:
    pool = WarmPool(size=1)
    try:
        job = make_job(small_config, "a")
        job.pause_at = 20
        run_rung_process(job, pool=pool)
        warm = pool.take()
        assert warm is not None
        os.kill(warm.proc.pid, signal.SIGKILL)  # dies while idle
        warm.proc.wait()
        pool.give(warm)
        job.pause_at = 40
        assert run_rung_process(job, pool=pool).step == 40  # in a fresh child
        bad = small_config.model_copy(deep=True)
        bad.model.factory = "no_such_module:build"
        with pytest.raises(ConfigError, match="no_such_module"):
            run_training_process(make_job(bad, "bad"), pool=pool)
        assert pool.take() is None  # the child of the failed job exited
    finally:
        pool.close()
