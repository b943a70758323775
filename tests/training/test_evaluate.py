from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.training.helpers import make_job
from training.config import EvalConfig, RetrainConfig
from training.evaluate import decide_promotion, promote, read_champion
from training.loop import train
from training.stages import evaluate_stage, pack_stage


def test_decisions() -> None:
    cfg = EvalConfig(min_delta=0.01)
    assert decide_promotion("a", {"auc": 0.8}, None, None, cfg) == (True, "no champion yet; test AUC 0.8000")
    assert not decide_promotion("a", {"auc": 0.805}, "b", {"auc": 0.8}, cfg)[0]  # gain below min_delta
    assert decide_promotion("a", {"auc": 0.82}, "b", {"auc": 0.8}, cfg)[0]
    assert not decide_promotion("a", {"auc": 0.9}, "a", {"auc": 0.9}, cfg)[0]
    ok, why = decide_promotion("a", {"auc": 0.7}, None, None, EvalConfig(target_auc=0.75))
    assert not ok and "below eval.target_auc" in why


def _trained(config: RetrainConfig, name: str) -> tuple[dict, dict]:
    packed = pack_stage(config)
    job = make_job(config, name)
    result = train(job)
    return packed, {**result, "run_dir": job.run_dir}


def test_worse_challenger_keeps_the_champion_a_better_one_is_promoted(small_config: RetrainConfig) -> None:
    packed, good = _trained(small_config, "good")
    first = evaluate_stage(small_config, packed, good)
    assert first["promotion"]["promoted"]
    champion = read_champion(Path(small_config.storage.root) / "models")
    assert champion["sha256"] == good["model"]["sha256"]

    small_config.train.max_steps = 3  # barely trained: worse
    small_config.train.eval_every = 3
    packed, bad = _trained(small_config, "bad")
    second = evaluate_stage(small_config, packed, bad)
    assert not second["promotion"]["promoted"]
    assert second["promotion"]["champion_metrics"]["auc"] > second["metrics"]["auc"]
    assert read_champion(Path(small_config.storage.root) / "models") == champion

    small_config.train.max_steps = 200  # trained longer: better
    small_config.train.eval_every = 20
    packed, better = _trained(small_config, "better")
    third = evaluate_stage(small_config, packed, better)
    assert third["metrics"]["auc"] > third["promotion"]["champion_metrics"]["auc"]
    assert third["promotion"]["promoted"], third["promotion"]["reason"]
    assert read_champion(Path(small_config.storage.root) / "models")["sha256"] == better["model"]["sha256"]


def test_crash_between_the_two_promotion_writes_keeps_a_consistent_champion(
    small_config: RetrainConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    packed, good = _trained(small_config, "good")
    evaluate_stage(small_config, packed, good)
    models = Path(small_config.storage.root) / "models"
    before = (models / "champion").read_bytes()

    import training.evaluate as ev

    def crash(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt("killed between package copy and pointer swap")

    monkeypatch.setattr(ev, "write_json_atomic", crash)
    other = Path(good["run_dir"])
    with pytest.raises(KeyboardInterrupt):
        promote(models, other / "model", "f" * 64, {"run_key": "x"})
    assert (models / "champion").read_bytes() == before
    pointer = json.loads(before)
    assert (models / pointer["sha256"] / "model.pt").exists()
    assert not [p for p in os.listdir(models) if ".tmp-" in p]
