"""A run written by an earlier version of this code stays what it was: the same config gives the
same run key, its checkpoint (made by that code, committed under tests/fixtures/legacy_run) is
resumed, and training ends with the weights that code ended with."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.conftest import small_overrides
from tests.training.helpers import make_job
from training.trainer.events import ChildEvent
from training.config import load_config

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "legacy_run"


def test_an_earlier_versions_checkpoint_resumes_to_its_weights(demo_source: Path, tmp_path: Path) -> None:
    from training.trainer.run import train

    expected = json.loads((FIXTURE / "expected.json").read_text())
    config = load_config(overrides=small_overrides(tmp_path / "root", demo_source))
    job = make_job(config)
    assert job.run_key == expected["run_key"]  # the run key did not move
    shutil.copytree(FIXTURE / "step-00000040", Path(job.run_dir) / "checkpoints" / "step-00000040")
    events: list[ChildEvent] = []
    result = train(job, emit=events.append)
    assert [e.step for e in events if e.event == "resumed"] == [40]
    assert result.model.sha256 == expected["final_weights_sha256"]
    assert [v.to_json() for v in result.history] == expected["history"]
