"""A run written by an earlier version of this code stays what it was: the dataset that version
packed (format 1, whole-source shards) is read as it is, the same config gives the same run key,
its checkpoint (made by that code, committed under tests/fixtures/legacy_run with the dataset)
is resumed, and training ends with the weights that code ended with.

"The same weights" is to float rounding, not to the bit: the fixture was made on one CPU, and
PyTorch's CPU kernels round differently on others (AVX-512 against AVX2 changed the last bits of
the final weights and of one validation log loss). Bit-identical resume on one machine is
tested elsewhere (tests/training/trainer/test_resume.py, test_preemption.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import SMALL_ROWS, small_overrides
from tests.training.helpers import make_job
from training.protocol.events import ChildEvent
from training.config import load_config

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "legacy_run"


def test_an_earlier_versions_checkpoint_resumes_to_its_weights(tmp_path: Path) -> None:
    from training.data.ingest.demo import ensure_demo_dataset
    from training.trainer.run import train

    expected = json.loads((FIXTURE / "expected.json").read_text())
    source, _ = ensure_demo_dataset(tmp_path / "src", rows=SMALL_ROWS, seed=7)  # the file that version packed
    # That version's overrides (data.segment_rows did not exist), and its defaults where they changed since.
    overrides = [o for o in small_overrides(tmp_path / "root", source) if not o.startswith("data.segment_rows")]
    # ... and its device: the checkpoint was made on a CPU, and on a GPU the run would compute
    # (and be keyed) otherwise.
    overrides += ["train.patience=5", "model.numeric_embedding=none", "train.optim.fused=false", "train.device=cpu"]
    config = load_config(overrides=overrides)
    shutil.copytree(FIXTURE / "datasets", tmp_path / "root" / "datasets")
    job = make_job(config)
    assert job.run_key == expected["run_key"]  # the run key did not move
    shutil.copytree(FIXTURE / "step-00000040", Path(job.run_dir) / "checkpoints" / "step-00000040")
    events: list[ChildEvent] = []
    result = train(job, emit=events.append)
    assert [e.step for e in events if e.event == "resumed"] == [40]
    final = torch.load(result.model.uri, weights_only=True)
    wanted = torch.load(FIXTURE / "final_weights.pt", weights_only=True)
    assert final.keys() == wanted.keys()
    for name, tensor in wanted.items():
        torch.testing.assert_close(final[name], tensor, rtol=1e-4, atol=1e-6, msg=name)
    history = [v.to_json() for v in result.history]
    assert [h["step"] for h in history] == [h["step"] for h in expected["history"]]
    for got, want in zip(history, expected["history"], strict=True):
        assert got == pytest.approx(want, rel=1e-6)
