"""Incremental retraining: steps to reach a target validation AUC, warm-started from last
week's champion versus a fresh start, on this week's data (last week's rows plus new ones)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from training.config import load_config
from training.data.demo import ensure_demo_dataset
from training.pipeline.evaluate_stage import evaluate_stage
from training.pipeline.pack_stage import pack_stage
from training.pipeline.preprocess_stage import preprocess_stage
from training.pipeline.train_stage import train_stage


def _run(overrides: list[str]) -> dict[str, Any]:
    config = load_config(overrides=overrides)
    packed = pack_stage(config)
    prep = preprocess_stage(packed.dataset_dir, config.preprocess.model_dump(), config.storage.root)
    trained = train_stage(config, packed, prep)
    evaluation = evaluate_stage(config, packed, trained)
    return {"trained": trained, "evaluation": evaluation, "history": trained.history}


def _steps_to(history: list[Any], target: float) -> int | None:
    return next((v.step for v in history if v["auc"] >= target), None)


def run(work: Path) -> dict[str, Any]:
    full, _ = ensure_demo_dataset(work / "gen", rows=400_000, seed=11)
    table = pq.read_table(full)
    week1 = work / "week1.parquet"
    pq.write_table(table.slice(0, 200_000), week1)
    root = work / "root"
    common = [f"storage.root={root}", "train.eval_every=50", "train.patience=0", "train.max_steps=2000"]
    _run(common + [f"data.source={week1}"])  # last week's champion
    cold = _run(common + [f"data.source={full}"])
    warm = _run(common + [f"data.source={full}", "train.init_from=champion"])
    assert warm["trained"].warm_start.used, warm["trained"].warm_start
    best_cold = max(h["auc"] for h in cold["history"])
    target = round(best_cold - 0.002, 4)
    cold_steps, warm_steps = _steps_to(cold["history"], target), _steps_to(warm["history"], target)
    return {
        "target_val_auc": target,
        "cold_steps_to_target": cold_steps,
        "warm_steps_to_target": warm_steps,
        "warm_over_cold_steps": round(warm_steps / cold_steps, 3) if cold_steps and warm_steps else None,
        "cold_test_auc": round(cold["evaluation"].metrics["auc"], 4),
        "warm_test_auc": round(warm["evaluation"].metrics["auc"], 4),
        "eval_every": 50,
    }
