from __future__ import annotations

from training.config import RetrainConfig
from training.pipeline.evaluate_stage import evaluate_stage
from training.pipeline.pack_stage import pack_stage
from training.pipeline.preprocess_stage import preprocess_stage
from training.pipeline.train_stage import train_stage


def _run(config: RetrainConfig) -> dict:
    packed = pack_stage(config)
    prep = preprocess_stage(packed.dataset_dir, config.preprocess.model_dump(), config.storage.root)
    trained = train_stage(config, packed, prep)
    evaluate_stage(config, packed, trained)
    return trained


def test_warm_start_from_a_compatible_champion(small_config: RetrainConfig) -> None:
    small_config.eval.target_auc = 0.55
    first = _run(small_config)
    assert not first.warm_start.used

    small_config.train.init_from = "champion"
    small_config.train.max_steps = 20
    small_config.train.eval_every = 5
    warm = _run(small_config)
    assert warm.warm_start.used, warm.warm_start.reason
    assert warm.warm_start.champion_sha256 == first.model.sha256
    assert warm.run_key != first.run_key
    # starting from a trained model, the first validation already clears the target
    assert warm.steps_to_target == 5


def test_incompatible_champion_falls_back_to_a_fresh_start(small_config: RetrainConfig) -> None:
    _run(small_config)
    small_config.train.init_from = "champion"
    small_config.model.hidden = [8]
    trained = _run(small_config)
    assert not trained.warm_start.used
    assert "model config differs" in trained.warm_start.reason


def test_no_champion_means_fresh_start(small_config: RetrainConfig) -> None:
    small_config.train.init_from = "champion"
    trained = _run(small_config)
    assert trained.warm_start is not None and trained.warm_start.to_json() == {"requested": True, "used": False, "reason": "no champion yet: fresh start",
                                     "champion_sha256": None}
