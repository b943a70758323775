"""Budgeted tuning against naive search: the cost (machine seconds x the spot price) to reach the
best validation AUC that a random search of N full-fidelity trials finds, for

- the reference: that random search (tune.sampler random, tune.pruner none, max_trials N);
- ASHA as `retrain tune` runs it by default (TPE + tune.pruner asha), with the random search's
  total spend as its tune.max_usd (up to 10N trials: the budget binds);

same demo data, same seed, same search space, and the same machinery (real training children
kept warm between rungs and trials, pauses at rungs, calibration and set-up counted). A study
reaches the target when one of its full-fidelity trials scores at least it; its cost then is
everything spent up to that trial.

Where a random search finds its best is luck: at its 2nd trial with one seed, its 9th with
another. So the comparison is repeated for several seeds (each pair of studies shares one) and
reported per seed and as the ratio of the summed costs. Target: ASHA / random <= 0.5.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from training.config import load_config
from training.protocol.results import RungResult
from training.pipeline.pack_stage import pack_stage
from training.pipeline.preprocess_stage import preprocess_stage
from training.tune.driver import drive, open_study
from training.tune.study_report import build_report
from training.tune.study import RungWork
from training.tune.trial import rung_stage

from benchmarks.common import demo_parquet

# The reference case: at most 40 trials. With N = 10 the random search reaches its best
# after 5.5 full trials on average, and no schedule replayed on 200 real learning curves gets
# below 0.85x of that (benchmarks/bench_tuning_replay.py); with N = 40 the target is a better
# AUC, worth exploring many configurations cheaply for.
N = 40
# Three seed pairs: each pair is two whole studies of 40 full-fidelity runs' worth, about 16
# minutes on a 2-core machine. Telling schedules apart takes hundreds of orders, which
# bench_tuning_replay replays; this benchmark checks that the whole machinery delivers them.
SEEDS = (0, 1, 2)
# The rungs are `retrain tune`'s defaults (tune.min_resource and tune.reduction_factor unset):
# at 540 steps, 100, 200, 400 and 540, the schedule bench_tuning_replay ranks cheapest on the
# demo. The whole study measures what a user gets, not a schedule chosen for the benchmark.
# A learning rate over four decades, as a search usually starts (Optuna's own examples draw
# 1e-5..1e-1): many draws train poorly, which is what a low rung finds out cheaply. A pre-tuned
# range, where nearly every draw ends within noise of the best, leaves a search nothing to prune.
SPACE = {"train.optim.lr": "loguniform(1e-5, 1e-1)", "model.dropout": "uniform(0, 0.4)",
         "model.hidden": "choice([[32], [128, 64], [256, 128]])"}


class _Done:
    """A future already resolved: the benchmark trains its rungs one after another."""

    def __init__(self, outcome: RungResult) -> None:
        self.outcome = outcome

    def result(self) -> RungResult:
        return self.outcome


def _study(work: Path, source: Path, name: str, seed: int, tune: dict[str, Any]) -> dict[str, Any]:
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "storage": {"root": str(work / name)},
        "data": {"source": str(source)},
        "train": {"max_steps": 540, "eval_every": 20, "checkpoint": {"every": 20}, "batch_size": 2048,
                  "schedule": {"warmup_steps": 20}, "patience": 0, "loader": {"num_workers": 0}},
        "cost": {"instance_type": "g4dn.xlarge", "market": "spot"},
        "tune": {"space": SPACE, "seed": seed, **tune},
    }))
    config = load_config(path)
    packed = pack_stage(config)
    prep = preprocess_stage(packed.dataset_dir, config.preprocess, config.storage)
    study = open_study(config, packed, prep, lambda event: None)

    def submit(w: RungWork) -> _Done:
        return _Done(rung_stage(w.config, packed, prep, w.step, lambda event: None))

    drive(study, submit, lambda futures: futures[0], lambda line: None)
    return build_report(study).model_dump(mode="json")


def _cost_to_reach(report: dict[str, Any], target: float) -> float | None:
    """$ spent (set-up, calibration and every trial so far) when a full-fidelity trial first
    scored >= target; None if none did."""
    spent = sum(report["spend"]["setup_seconds"].values()) * report["rate_per_hour"] / 3600
    for trial in report["trials"]:
        spent += trial["usd"]
        if trial["state"] in ("completed", "early_stopped") and trial["value"] >= target:
            return spent
    return None


def _pair(work: Path, source: Path, seed: int) -> dict[str, Any]:
    random = _study(work, source, f"random-{seed}", seed, {"sampler": "random", "pruner": "none", "max_trials": N})
    target = max(t["value"] for t in random["trials"] if t["value"] is not None)
    # The budget binds, not max_trials: ASHA may try as many configurations as the random
    # search's spend pays for.
    asha = _study(work, source, f"asha-{seed}", seed, {"max_trials": 10 * N, "max_usd": random["spend"]["usd"]})
    random_cost, asha_cost = _cost_to_reach(random, target), _cost_to_reach(asha, target)
    best_at = next(i for i, t in enumerate(random["trials"]) if t["value"] == target)
    return {
        "seed": seed,
        "target_val_auc": target,
        "random_search": {"trials": N, "best_at_trial": best_at, "usd_to_reach": random_cost,
                          "usd_total": random["spend"]["usd"]},
        "asha": {"trials": len(asha["trials"]), "usd_to_reach": asha_cost, "usd_total": asha["spend"]["usd"],
                 "best_val_auc": asha["best"]["value"] if asha["best"] else None, "status": asha["status"],
                 "pruned": sum(t["state"] == "pruned" for t in asha["trials"]), "rungs": asha["rungs"]},
        "ratio_asha_over_random": None if asha_cost is None or random_cost is None else asha_cost / random_cost,
    }


def run(work: Path) -> dict[str, Any]:
    source = demo_parquet(work, rows=200_000)
    pairs = [_pair(work, source, seed) for seed in SEEDS]
    reached = all(p["asha"]["usd_to_reach"] is not None for p in pairs)
    # A seed where ASHA never reaches the target counts as its whole spend: a lower bound on its
    # cost, flagged by "reached": false.
    asha_sum = sum(p["asha"]["usd_to_reach"] or p["asha"]["usd_total"] for p in pairs)
    random_sum = sum(p["random_search"]["usd_to_reach"] for p in pairs)
    ratio = asha_sum / random_sum
    return {
        "seeds": pairs,
        "asha_usd_to_reach_summed": asha_sum,
        "random_usd_to_reach_summed": random_sum,
        "ratio_asha_over_random": ratio,
        "asha_reached_every_target": reached,
        "target_ratio": 0.5,
        "met": reached and ratio <= 0.5,
    }
