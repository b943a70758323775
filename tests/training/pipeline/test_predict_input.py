"""Predict's input, checked before a model is loaded: a folder that holds nothing yet is a skip
(a deployment triggered before the first file lands), a path that does not exist is an error."""

from __future__ import annotations

from pathlib import Path

import pytest

from training.errors import DataError
from training.pipeline.predict_stage import nothing_to_score


def test_a_missing_input_fails_and_an_empty_folder_is_a_skip(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"the input .*nowhere does not exist"):
        nothing_to_score(str(tmp_path / "nowhere"))
    (tmp_path / "incoming").mkdir()
    assert "holds no .parquet or .csv file yet" in (nothing_to_score(str(tmp_path / "incoming")) or "")
    (tmp_path / "incoming" / "a.parquet").write_bytes(b"PAR1")
    assert nothing_to_score(str(tmp_path / "incoming")) is None


def test_predict_names_a_missing_input_before_it_looks_for_a_model(tmp_path: Path) -> None:
    from training.config import load_config
    from training.pipeline.predict_stage import predict_stage

    # A root with no champion: the input's line comes first, before any model is resolved.
    config = load_config(overrides=[f"storage.root={tmp_path / 'root'}"])
    with pytest.raises(DataError, match=r"the input .*nowhere.parquet does not exist"):
        predict_stage(config, str(tmp_path / "nowhere.parquet"), str(tmp_path / "scores.csv"))
