"""A disk that fills up during training, on a real small filesystem and a real child process."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from tests.conftest import small_filesystem
from tests.training.helpers import make_job
from training.protocol.events import ChildEvent
from training.trainer.checkpoint import latest_verified_checkpoint
from training.config import RetrainConfig
from training.errors import StorageError
from training.launch.process import run_training_process


def _fill(disk: Path) -> Path:
    """Write a ballast file until the filesystem is full."""
    ballast = disk / "ballast"
    with open(ballast, "wb", buffering=0) as f:  # unbuffered: no bytes left to fail at close
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError as err:
            assert err.errno == errno.ENOSPC
    return ballast


@pytest.mark.slow
def test_a_full_disk_stops_training_in_one_line_and_a_rerun_resumes(small_config: RetrainConfig, tmp_path: Path) -> None:
    small_config.train.max_steps = 200
    small_config.train.checkpoint.every = 20
    small_config.train.eval_every = 20
    small_config.train.checkpoint.keep_last = 2
    with small_filesystem(tmp_path / "disk", 8192) as disk:
        small_config.storage.root = str(disk / "root")
        job = make_job(small_config)
        ballast: list[Path] = []
        steps: list[int] = []

        def on_event(event: ChildEvent) -> None:
            steps.append(getattr(event, "step", 0))
            if event.event == "checkpoint" and event.step == 40 and not ballast:
                ballast.append(_fill(disk))

        with pytest.raises(StorageError) as caught:
            run_training_process(job, on_event)
        message = str(caught.value)
        assert message.startswith("checkpoint write failed at ") and "No space left on device" in message, message
        assert "run the same command again to resume" in message and "\n" not in message
        ckpts = Path(job.run_dir) / "checkpoints"
        assert not list(ckpts.glob(".step-*")), "a torn temp folder was left behind"
        found = latest_verified_checkpoint(ckpts)
        # Earlier checkpoints survive, verified (the one at 40 may have been in flight when the disk filled).
        assert found is not None and found[1].step >= 20
        failed_step = int(message.split("/step-")[1][:8])
        assert failed_step > found[1].step
        # Training went on only while the failed save was retried in the background: it
        # stopped by the next checkpoint, not a whole run later.
        assert max(steps) <= failed_step + 20

        ballast[0].unlink()
        result = run_training_process(job)
        assert result.status == "completed" and result.steps == 200
        assert result.resumed_from_steps == [found[1].step]
