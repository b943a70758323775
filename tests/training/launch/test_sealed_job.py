"""The training child trains the job its parent wrote, not one swapped into the storage root
during its start-up: a watcher that replaces `runs/<key>/job.json` between the parent's write
and the child's read (another run's settings, a run folder outside the root, a factory that is
any callable) wins nothing. A real child process reads it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.training.helpers import make_job
from training.config import RetrainConfig
from training.errors import StorageError
from training.launch.process import run_training_process
from training.protocol.job import TrainJob
from training.protocol.sealed import Sealed


def test_a_job_swapped_before_the_child_reads_it_is_refused(small_config: RetrainConfig, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    job = make_job(small_config)
    outside = tmp_path / "outside-the-root"
    sealed_by_parent = TrainJob.seal

    def seal_then_lose_the_race(self: TrainJob, path: Path) -> Sealed:
        sealed = sealed_by_parent(self, path)
        planted = json.loads(path.read_text())  # the watcher's version of the same file
        planted["run_dir"] = str(outside)
        planted["config"]["train"]["optim"]["lr"] = 0.5
        planted["config"]["model"]["factory"] = "builtins:print"
        path.write_text(json.dumps(planted))
        return sealed

    monkeypatch.setattr(TrainJob, "seal", seal_then_lose_the_race)
    with pytest.raises(StorageError, match=r"the training job .*job\.json changed after the parent wrote it"):
        run_training_process(job)
    assert not outside.exists()
    assert not (Path(job.run_dir) / "checkpoints").exists() or not any((Path(job.run_dir) / "checkpoints").iterdir())
