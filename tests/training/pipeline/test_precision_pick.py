"""train.precision auto on a GPU is what is measured faster for the model at its batch, decided
once for the run key and kept; bf16 must win beyond the noise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.config import RetrainConfig
from training.pipeline import precision_pick
from training.pipeline.pack_stage import pack_stage
from training.pipeline.preprocess_stage import preprocess_stage
from training.protocol.numerics import PrecisionPick, pick_precision


def test_bf16_only_where_it_wins_beyond_the_noise() -> None:
    assert pick_precision({"fp32": [1.0, 1.0, 1.0], "bf16": [0.5, 0.5, 0.5]}, "g").precision == "bf16"
    assert pick_precision({"fp32": [1.0, 1.0, 1.0], "bf16": [0.97, 0.97, 0.97]}, "g").precision == "fp32"  # < 5 %
    # fp32 swung 30 % over its rounds: a 20 % gain is inside that.
    assert pick_precision({"fp32": [1.0, 1.3, 1.1], "bf16": [0.88] * 3}, "g").precision == "fp32"
    # The default MLP on an H200: fp32 1.27x faster.
    assert pick_precision({"fp32": [1 / 153.6] * 3, "bf16": [1 / 121.1] * 3}, "H200").precision == "fp32"


def test_the_measurement_picks_fp32_where_fp32_is_faster(small_config: RetrainConfig) -> None:
    """On this CPU (no native bf16) autocast's bf16 is several times slower: measured, not assumed."""
    packed = pack_stage(small_config)
    prep = preprocess_stage(packed.dataset_dir, small_config.preprocess, small_config.storage)
    pick = precision_pick.measure_precision(small_config, packed, prep)
    assert pick.precision == "fp32" and len(pick.fp32_seconds) == 3
    assert sorted(pick.bf16_seconds)[1] > sorted(pick.fp32_seconds)[1]


def test_the_pick_is_made_once_and_a_planted_one_is_measured_again(small_config: RetrainConfig,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    packed = pack_stage(small_config)
    prep = preprocess_stage(packed.dataset_dir, small_config.preprocess, small_config.storage)
    calls: list[int] = []

    def measured(config: RetrainConfig, packed: object, prep: object) -> PrecisionPick:
        calls.append(1)
        return PrecisionPick(precision="bf16", gpu="NVIDIA H200", fp32_seconds=[2.0], bf16_seconds=[1.0])

    import training.pipeline.stage_calls as stage_calls

    monkeypatch.setattr(stage_calls, "precision_in_child", measured)
    monkeypatch.setattr(precision_pick, "gpu_name", lambda: "NVIDIA H200")
    assert precision_pick.auto_precision(small_config, packed, prep, "k" * 16) == "bf16"
    assert precision_pick.auto_precision(small_config, packed, prep, "k" * 16) == "bf16"
    assert calls == [1]  # stored, read back

    stored = Path(small_config.storage.root) / "plan" / "precision" / f"{'k' * 16}.json"
    for planted in ({"precision": "int4"}, {"extra": 1}, {"gpu": "NVIDIA T4"}):
        stored.write_text(json.dumps({**json.loads(stored.read_text()), **planted}))
        assert precision_pick.auto_precision(small_config, packed, prep, "k" * 16) == "bf16"
    assert calls == [1, 1, 1, 1]
