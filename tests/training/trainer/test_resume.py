"""Resume bookkeeping on its own: which checkpoint an attempt resumes from, what the dead attempt
lost (from the heartbeat), and the ledger, without training anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from training.protocol.runs import count_attempt
from training.trainer.checkpoint import CheckpointManifest, save_checkpoint
from training.config import load_config
from training.errors import CheckpointError
from training.trainer.resume import Heartbeat
from training.protocol.job import TrainJob
from training.trainer.resume import ResumeBook
from training.trainer.state import Progress

FINGERPRINT = "fp-1"


def _job(tmp_path: Path, run_key: str = "run-a") -> TrainJob:
    config = load_config(overrides=[f"storage.root={tmp_path / 'root'}"])
    return TrainJob(run_key=run_key, run_dir=str(tmp_path / "root" / "runs" / run_key), dataset_dir="", stats_path="",
                    config=config)


def _checkpoint(job: TrainJob, step: int, train_seconds: float, run_key: str | None = None) -> None:
    progress = Progress(step=step)
    progress.seconds.train = train_seconds
    manifest = CheckpointManifest(step, run_key or job.run_key, FINGERPRINT, {})
    save_checkpoint(Path(job.run_dir) / "checkpoints", manifest, {"run": progress.state_dict()})


def _died_at(job: TrainJob, step: int, train_seconds: float) -> None:
    """A dead attempt's last heartbeat."""
    Path(job.run_dir).mkdir(parents=True, exist_ok=True)
    beat = Heartbeat(Path(job.run_dir) / "heartbeat.bin")
    beat.write(step, train_seconds)
    beat.close()


def _attempt(job: TrainJob) -> tuple[ResumeBook, Progress]:
    Path(job.run_dir).mkdir(parents=True, exist_ok=True)
    count_attempt(Path(job.run_dir))  # as the launcher does before each start
    book = ResumeBook(job, spawn_time=0.0)
    progress = Progress()
    saved = book.latest_checkpoint(FINGERPRINT)
    if saved is not None:
        progress.load_state_dict(saved["run"])
    book.account(progress)
    book.heartbeat.close()
    return book, progress


def test_a_first_attempt_resumes_nothing_and_lost_nothing(tmp_path: Path) -> None:
    book, progress = _attempt(_job(tmp_path))
    assert book.resumed_step is None and book.resumed_from is None
    assert progress.resumed_from_steps == [] and progress.steps_lost == 0 and progress.preemptions == 0
    assert progress.seconds.startup > 0  # measured from the spawn time


def test_work_past_the_last_checkpoint_is_counted_as_lost(tmp_path: Path) -> None:
    job = _job(tmp_path)
    _checkpoint(job, step=20, train_seconds=10.0)
    _died_at(job, step=35, train_seconds=18.0)
    book, progress = _attempt(job)
    assert book.resumed_step == 20 and book.resumed_from is not None and book.resumed_from.name.endswith("20")
    assert progress.step == 20 and progress.resumed_from_steps == [20]
    assert progress.steps_lost == 15 and progress.seconds.lost == pytest.approx(8.0)


def test_an_attempt_that_died_before_its_first_checkpoint_lost_everything(tmp_path: Path) -> None:
    job = _job(tmp_path)
    _died_at(job, step=12, train_seconds=6.0)
    book, progress = _attempt(job)
    assert book.resumed_step == 0 and book.resumed_from is None
    assert progress.resumed_from_steps == [0] and progress.steps_lost == 12


def test_the_ledger_accumulates_across_attempts(tmp_path: Path) -> None:
    job = _job(tmp_path)
    _attempt(job)
    _checkpoint(job, step=10, train_seconds=5.0)
    _died_at(job, step=14, train_seconds=7.0)
    _attempt(job)
    _died_at(job, step=16, train_seconds=8.0)
    _, progress = _attempt(job)
    assert progress.resumed_from_steps == [10, 10] and progress.steps_lost == 4 + 6
    assert progress.preemptions == 2


def test_a_checkpoint_of_another_run_is_refused_not_trained_over(tmp_path: Path) -> None:
    job = _job(tmp_path)
    _checkpoint(job, step=20, train_seconds=10.0, run_key="someone-else")
    with pytest.raises(CheckpointError, match="belongs to run someone-else"):
        ResumeBook(job).latest_checkpoint(FINGERPRINT)
