"""Incremental retraining: steps to reach a target validation AUC, warm-started from last
week's champion versus a fresh start, on this week's data (last week's rows plus new ones); the
warm start at its default peak learning rate (train.warm_lr_scale) and at the fresh start's.
And a daily run on data that grew by 1 %: the short warm start's test AUC against its champion's."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from training.config import load_config
from training.data.ingest.demo import ensure_demo_dataset
from training.pipeline.evaluate_stage import evaluate_stage
from training.pipeline.pack_stage import pack_stage
from training.pipeline.preprocess_stage import preprocess_stage
from training.pipeline.train_stage import train_stage
from training.registry.champion import champion_of


def _run(overrides: list[str]) -> dict[str, Any]:
    config = load_config(overrides=overrides)
    packed = pack_stage(config)
    prep = preprocess_stage(packed.dataset_dir, config.preprocess, config.storage)
    trained = train_stage(config, packed, prep, champion_of(config))
    evaluation = evaluate_stage(config, packed, trained)
    return {"trained": trained, "evaluation": evaluation, "history": trained.history}


def _steps_to(history: list[Any], target: float) -> int | None:
    return next((v.step for v in history if v["auc"] >= target), None)


def _warm(root: Path, copy: Path, overrides: list[str]) -> dict[str, Any]:
    """A warm start from `root`'s champion, on a copy of the root: each variant starts from the
    same champion (a promoted one would be the next variant's)."""
    shutil.copytree(root, copy)
    warm = _run([f"storage.root={copy}", *overrides, "train.init_from=champion"])
    assert warm["trained"].warm_start.used, warm["trained"].warm_start
    return warm


def _test_auc(result: dict[str, Any]) -> float:
    return round(result["evaluation"].metrics["auc"], 4)


def _grown_by_one_percent(work: Path, table: pa.Table, common: list[str]) -> dict[str, Any]:
    """Data that grew by 1 %: the warm start is short (warm_steps), and ends where its peak
    learning rate left it. Its test AUC against its champion's, re-scored on the same rows."""
    folder = work / "daily"
    folder.mkdir()
    pq.write_table(table.slice(0, 200_000), folder / "day-1.parquet")
    _run([f"storage.root={work / 'daily-root'}", *common, f"data.source={folder}"])
    pq.write_table(table.slice(200_000, 2_000), folder / "day-2.parquet")
    out: dict[str, Any] = {}
    for scale in (0.1, 1.0):
        warm = _warm(work / "daily-root", work / f"daily-{scale}", [*common, f"data.source={folder}",
                                                                    f"train.warm_lr_scale={scale}"])
        out[f"warm_lr_scale_{scale}"] = {"steps": warm["trained"].history[-1].step, "test_auc": _test_auc(warm),
                                         "champion_test_auc": round(warm["evaluation"].promotion.champion_metrics["auc"], 4)}
    return out


def run(work: Path) -> dict[str, Any]:
    full, _ = ensure_demo_dataset(work / "gen", rows=400_000, seed=11)
    table = pq.read_table(full)
    week1 = work / "week1.parquet"
    pq.write_table(table.slice(0, 200_000), week1)
    common = ["train.eval_every=50", "train.patience=0", "train.max_steps=2000"]
    _run([f"storage.root={work / 'root'}", *common, f"data.source={week1}"])  # last week's champion
    # The fresh start on a root of its own: promoted on the shared root, it would be the champion
    # the warm start starts from, trained on this week's data already.
    cold = _run([f"storage.root={work / 'cold'}", *common, f"data.source={full}"])
    warm = _warm(work / "root", work / "warm", [*common, f"data.source={full}"])
    full_peak = _warm(work / "root", work / "warm-full-peak", [*common, f"data.source={full}", "train.warm_lr_scale=1"])
    target = round(max(h["auc"] for h in cold["history"]) - 0.002, 4)
    cold_steps, warm_steps = _steps_to(cold["history"], target), _steps_to(warm["history"], target)
    return {
        "target_val_auc": target,
        "cold_steps_to_target": cold_steps,
        "warm_steps_to_target": warm_steps,
        "warm_over_cold_steps": round(warm_steps / cold_steps, 3) if cold_steps and warm_steps else None,
        "warm_full_peak_lr_steps_to_target": _steps_to(full_peak["history"], target),
        "cold_test_auc": _test_auc(cold),
        "warm_test_auc": _test_auc(warm),
        "warm_full_peak_lr_test_auc": _test_auc(full_peak),
        "eval_every": 50,
        "grown_by_one_percent": _grown_by_one_percent(work, table, common),
    }
