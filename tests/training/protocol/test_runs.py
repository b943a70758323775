"""What the launcher reads back from a run's folder before it trains: a finished run's
result.json, which anyone who can write the storage root may have damaged."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from training.config import load_config
from training.protocol.job import TrainJob
from training.protocol.runs import finished_result

GOOD = b'{"run_key": "k", "model": {"sha256": "' + b"a" * 64 + b'"}}'


@pytest.mark.parametrize("damage", ["not-utf8", "truncated", "a-folder"])
def test_a_damaged_result_json_is_set_aside_and_the_run_counts_as_unfinished(
        tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    """The record is derived from the verified checkpoints: set aside (its bytes kept for a
    look), it never stops the run, which training then finishes again (tests/e2e/test_bad_input.py)."""
    run_dir = tmp_path / "root" / "runs" / "k"
    run_dir.mkdir(parents=True)
    result = run_dir / "result.json"
    damaged = {"not-utf8": b"\xff" + GOOD, "truncated": GOOD[:20], "a-folder": None}[damage]
    if damaged is None:
        result.mkdir()
        (result / "inside").write_text("x")
    else:
        result.write_bytes(damaged)
    job = TrainJob(run_key="k", run_dir=str(run_dir), dataset_dir=str(tmp_path / "dataset"),
                   stats_path=str(tmp_path / "stats.json"),
                   config=load_config(overrides=[f"storage.root={tmp_path / 'root'}"]))
    with caplog.at_level(logging.WARNING):
        assert finished_result(job) is None
    assert not result.exists()
    aside = list(run_dir.glob("result.json.damaged-*"))
    assert [p.read_bytes() for p in aside] == ([] if damaged is None else [damaged])
    (line,) = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert str(result) in line and "finished again from its checkpoints" in line
