"""Model quality against the models users would otherwise train, on datasets that installed
packages ship (nothing is downloaded): scikit-learn's diabetes, breast_cancer, wine and digits,
statsmodels' randhie and fair, and the project's demo (whose Bayes-optimal AUC is known).

For each dataset and each of SEEDS splits (`data.split_seed`; the small datasets' test splits
hold 18 to 200 rows, so one split alone is mostly noise), on the same train/validation/test
split (read back from the packed shards): the project with its defaults (the README's path:
only data.source and data.label set, the task and columns inferred, where the columns' types
say what they are), LightGBM and scikit-learn's HistGradientBoosting with their defaults (on
the train split; categories as their categoricals, where HistGradientBoosting's limit of 255
allows), and a linear model (ridge or logistic
regression on standardised numerics and one-hot categories). On the first split, also the
project after a `retrain tune` study (TPE and ASHA over learning rate, weight decay, dropout,
width and numeric embedding width) capped at TUNE_SECONDS of machine time, its answer taken as
`retrain tune` gives it (the config as given unless the best trial beats it on validation by
the paired interval), against the defaults on that split. A study cannot be capped at
LightGBM's own fit time, which is shorter than one training process's start-up. The figure is
the test metric of each (R² for regression, AUC for binary, accuracy for multiclass), averaged
over the splits, the project's gap to LightGBM and to the best of the three references, with
each one's fit time.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks.common import demo_parquet, train_job

METRIC = {"regression": "r2", "binary": "auc", "multiclass": "accuracy"}
SEEDS = (0, 1, 2)
TUNE_SECONDS = 120.0
TUNE_SPACE = {"train.optim.lr": "loguniform(3e-4, 1e-2)", "train.optim.weight_decay": "loguniform(1e-6, 1e-2)",
              "model.dropout": "uniform(0, 0.3)", "model.hidden": "choice([[128, 64], [256, 128], [256, 256, 128]])",
              "model.numeric_embedding_dim": "choice([8, 16, 24, 32])"}


@dataclass(frozen=True)
class Dataset:
    name: str
    task: str
    label: str
    numeric: list[str]
    categorical: list[str]
    write: Callable[[Path], Path]


def _sklearn(loader: str, label: str) -> Callable[[Path], Path]:
    def write(path: Path) -> Path:
        import sklearn.datasets

        bunch = getattr(sklearn.datasets, loader)(as_frame=True)
        frame = bunch.frame.rename(columns={"target": label})
        frame.columns = [str(c).replace(" ", "_") for c in frame.columns]
        pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), path)
        return path
    return write


def _statsmodels(name: str, prepare: Callable[[Any], Any]) -> Callable[[Path], Path]:
    def write(path: Path) -> Path:
        import statsmodels.api as sm

        frame = prepare(getattr(sm.datasets, name).load_pandas().data)
        pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), path)
        return path
    return write


def _fair(frame: Any) -> Any:
    frame = frame.assign(had_affair=(frame["affairs"] > 0).astype("int8")).drop(columns=["affairs"])
    return frame.astype({"occupation": "int64", "occupation_husb": "int64"})


def _demo(path: Path) -> Path:
    return demo_parquet(path.parent, 200_000)


def datasets() -> list[Dataset]:
    import sklearn.datasets

    def columns(loader: str) -> list[str]:
        return [str(c).replace(" ", "_") for c in getattr(sklearn.datasets, loader)(as_frame=True).data.columns]

    randhie_x = ["lncoins", "idp", "lpi", "fmde", "physlm", "disea", "hlthg", "hlthf", "hlthp"]
    return [
        Dataset("diabetes", "regression", "progression", columns("load_diabetes"), [],
                _sklearn("load_diabetes", "progression")),
        Dataset("breast_cancer", "binary", "benign", columns("load_breast_cancer"), [],
                _sklearn("load_breast_cancer", "benign")),
        Dataset("wine", "multiclass", "cultivar", columns("load_wine"), [], _sklearn("load_wine", "cultivar")),
        Dataset("digits", "multiclass", "digit", columns("load_digits"), [], _sklearn("load_digits", "digit")),
        Dataset("randhie", "regression", "mdvis", randhie_x, [], _statsmodels("randhie", lambda f: f)),
        Dataset("fair", "binary", "had_affair", ["rate_marriage", "age", "yrs_married", "children", "religious", "educ"],
                ["occupation", "occupation_husb"], _statsmodels("fair", _fair)),
        Dataset("demo", "binary", "clicked", ["price", "discount", "rating", "reviews_log", "position", "dwell_prev"],
                ["category", "device", "region", "brand"], _demo),
    ]


def _splits(job: Any) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(standardised numerics, category indices, label) of each split, as the model sees them."""
    from training.data.prepare.features import FeatureStats
    from training.data.load.loader import ShardBatches, iter_split
    from training.data.manifest import require_manifest

    dataset_dir = Path(job.dataset_dir)
    stats = FeatureStats.from_json(Path(job.stats_path).read_text())
    out: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for split in ("train", "validation", "test"):
        batches = ShardBatches(dataset_dir, require_manifest(dataset_dir), split, 4096, stats.transformer(),
                               shuffle=False, drop_last=False)
        parts = list(iter_split(batches))
        num, cat, label = (np.concatenate([p[k].numpy() for p in parts]) for k in ("num", "cat", "label"))
        out[split] = (num, cat, label)
    return out


def _one_hot(cat: np.ndarray, cardinalities: list[int]) -> np.ndarray:
    return np.concatenate([np.eye(c, dtype=np.float32)[cat[:, j]] for j, c in enumerate(cardinalities)] or
                          [np.zeros((len(cat), 0), np.float32)], axis=1)


def _score(task: str, y: np.ndarray, pred: np.ndarray) -> float:
    from sklearn.metrics import accuracy_score, r2_score, roc_auc_score

    if task == "regression":
        return float(r2_score(y, pred))
    if task == "binary":
        return float(roc_auc_score(y, pred))
    return float(accuracy_score(y, pred))


def _references(task: str, splits: dict[str, Any], cardinalities: list[int]) -> dict[str, dict[str, float]]:
    import lightgbm
    from sklearn.ensemble import HistGradientBoostingClassifier, HistGradientBoostingRegressor
    from sklearn.linear_model import LogisticRegression, Ridge

    (num, cat, y), (num_t, cat_t, y_t) = splits["train"], splits["test"]
    x, x_t = np.concatenate([num, cat], axis=1), np.concatenate([num_t, cat_t], axis=1)
    categorical = list(range(num.shape[1], x.shape[1]))
    out: dict[str, dict[str, float]] = {}
    t0 = time.perf_counter()
    pred: Any
    if task == "regression":
        gbm = lightgbm.LGBMRegressor(verbose=-1).fit(x, y, categorical_feature=categorical)
        pred = gbm.predict(x_t)
    else:
        gbm = lightgbm.LGBMClassifier(verbose=-1).fit(x, y, categorical_feature=categorical)
        proba: Any = gbm.predict_proba(x_t)
        pred = proba[:, 1] if task == "binary" else gbm.classes_[proba.argmax(axis=1)]
    out["lightgbm"] = {"metric": _score(task, y_t, pred), "seconds": time.perf_counter() - t0}
    t0 = time.perf_counter()
    # HistGradientBoosting bins a categorical column into at most 255 categories: a column with
    # more (the demo's 300 brands) goes in as its integer codes, as ordinal.
    mask = [j in categorical and cardinalities[j - num.shape[1]] <= 255 for j in range(x.shape[1])]
    if task == "regression":
        pred = HistGradientBoostingRegressor(categorical_features=mask, random_state=0).fit(x, y).predict(x_t)
    else:
        hgb = HistGradientBoostingClassifier(categorical_features=mask, random_state=0).fit(x, y)
        pred = hgb.predict_proba(x_t)[:, 1] if task == "binary" else hgb.predict(x_t)
    out["hgb"] = {"metric": _score(task, y_t, pred), "seconds": time.perf_counter() - t0}
    lin, lin_t = (np.concatenate([num, _one_hot(cat, cardinalities)], axis=1),
                  np.concatenate([num_t, _one_hot(cat_t, cardinalities)], axis=1))
    t0 = time.perf_counter()
    if task == "regression":
        pred = Ridge(alpha=1.0).fit(lin, y).predict(lin_t)
    else:
        model = LogisticRegression(max_iter=5000).fit(lin, y)
        pred = model.predict_proba(lin_t)[:, 1] if task == "binary" else model.predict(lin_t)
    out["linear"] = {"metric": _score(task, y_t, pred), "seconds": time.perf_counter() - t0}
    return out


def _project(work: Path, overrides: list[str], metric: str) -> tuple[Any, float, int, float]:
    """The project with its defaults: (its job, test metric, steps, training seconds)."""
    from training.data.manifest import require_manifest
    from training.model.evaluation import evaluate_package
    from training.protocol.results import TrainResult
    from training.trainer.run import train

    job = train_job(work, "defaults", overrides)
    t0 = time.perf_counter()
    result = train(job)
    assert isinstance(result, TrainResult), result
    seconds = time.perf_counter() - t0
    score = evaluate_package(Path(job.run_dir) / "model", Path(job.dataset_dir),
                             require_manifest(Path(job.dataset_dir)), None)[metric]
    return job, score, result.steps, seconds


def _tuned(work: Path, overrides: list[str], metric: str) -> dict[str, Any]:
    """A study capped at TUNE_SECONDS of machine time; its best trial's test metric."""
    from training.config import load_config
    from training.data.manifest import require_manifest
    from training.model.evaluation import evaluate_package
    from training.pipeline.pack_stage import pack_stage
    from training.pipeline.preprocess_stage import preprocess_stage
    from training.tune.driver import base_comparison, drive, open_study
    from training.tune.study_report import against_base, build_report
    from training.tune.trial import rung_stage

    config = load_config(overrides=[f"storage.root={work}", *overrides, f"tune.space={TUNE_SPACE}", "tune.max_trials=40",
                                    f"tune.max_wall_seconds={TUNE_SECONDS}", "train.loader.num_workers=0"])
    packed = pack_stage(config)
    prep = preprocess_stage(packed.dataset_dir, config.preprocess, config.storage)
    t0 = time.perf_counter()
    study = open_study(config, packed, prep, lambda event: None)
    drive(study, lambda w: _Done(rung_stage(w.config, packed, prep, w.step, lambda event: None)),
          lambda futures: futures[0], lambda line: None)
    # The study's answer, as `retrain tune` gives it: the config as given unless the best trial
    # beats it on validation by the paired interval.
    report = against_base(build_report(study), base_comparison(config, packed, lambda event: None),
                          config.eval.confidence)
    seconds = time.perf_counter() - t0
    assert report.best is not None and report.best.run_key, report.status
    score = evaluate_package(work / "runs" / report.best.run_key / "model", Path(packed.dataset_dir),
                             require_manifest(Path(packed.dataset_dir)), None)[metric]
    return {"score": score, "trials": len(report.trials), "seconds": seconds, "params": report.best.params,
            "base_kept": report.best.trial == 0}


class _Done:
    """A future already resolved: the rungs train one after another."""

    def __init__(self, outcome: Any) -> None:
        self.outcome = outcome

    def result(self) -> Any:
        return self.outcome


def _inferred(work: Path, overrides: list[str]) -> list[str]:
    """What `retrain run` infers from the source for these keys (the task, the columns), as the
    `--set` overrides it prints."""
    from training.config import load_config
    from training.data.ingest.source_check import checked_source

    _, inferred = checked_source(load_config(overrides=[f"storage.root={work / 'inferred'}", *overrides]))
    assert inferred is not None  # a source that is not the demo, with no columns named
    return inferred.overrides()


def _one(work: Path, data: Dataset) -> dict[str, Any]:
    from training.data.prepare.features import FeatureStats

    source = data.write(work / f"{data.name}.parquet")
    # The README's own path where the columns' types say it all: the label alone, the task and
    # the columns inferred. fair's categories are integer codes, and the demo's numbers hold
    # ids: there the columns are named, as a user would name them.
    base = [f"data.source={source}", f"data.label={data.label}"]
    if data.categorical:
        base += [f"data.task={data.task}", f"data.numeric={data.numeric}", f"data.categorical={data.categorical}"]
    else:
        base += _inferred(work, base)
    metric = METRIC[data.task]
    seeds = SEEDS if data.name != "demo" else SEEDS[:1]  # 20,000 test rows: one split is steady
    rows: dict[str, list[float]] = {"project": [], "lightgbm": [], "hgb": [], "linear": [], "steps": [],
                                    "project_seconds": [], "lightgbm_seconds": [], "hgb_seconds": [],
                                    "linear_seconds": []}
    for seed in seeds:
        job, score, steps, seconds = _project(work / data.name / f"split-{seed}", [*base, f"data.split_seed={seed}"],
                                              metric)
        stats = FeatureStats.from_json(Path(job.stats_path).read_text())
        if stats.task != data.task:
            raise RuntimeError(f"{data.name}: the task inferred from '{data.label}' is {stats.task}, not {data.task}")
        references = _references(data.task, _splits(job), stats.cardinalities)
        for name, value in (("project", score), ("steps", steps), ("project_seconds", seconds)):
            rows[name].append(value)
        for name, ref in references.items():
            rows[name].append(ref["metric"])
            rows[f"{name}_seconds"].append(ref["seconds"])
    tuned = _tuned(work / data.name / "tuned", [*base, f"data.split_seed={seeds[0]}"], metric)
    mean = {k: statistics.mean(v) for k, v in rows.items()}
    gaps = [p - g for p, g in zip(rows["project"], rows["lightgbm"], strict=True)]
    best_reference = max(mean["lightgbm"], mean["hgb"], mean["linear"])
    return {"task": data.task, "metric": metric, "splits": len(seeds), "inferred": not data.categorical,
            "project": round(mean["project"], 4), "lightgbm": round(mean["lightgbm"], 4),
            "hgb": round(mean["hgb"], 4), "linear": round(mean["linear"], 4),
            "project_minus_best_reference": round(mean["project"] - best_reference, 4),
            "project_minus_lightgbm": round(statistics.mean(gaps), 4),
            "worst_split_gap": round(min(gaps), 4), "project_steps": round(mean["steps"]),
            "project_seconds": round(mean["project_seconds"], 2), "lightgbm_seconds": round(mean["lightgbm_seconds"], 2),
            "tuned": round(tuned["score"], 4), "tuned_lightgbm_split_0": round(rows["lightgbm"][0], 4),
            "tuned_minus_lightgbm": round(tuned["score"] - rows["lightgbm"][0], 4),
            "defaults_split_0": round(rows["project"][0], 4),
            "tuned_minus_defaults_split_0": round(tuned["score"] - rows["project"][0], 4),
            "tuned_kept_the_defaults": tuned["base_kept"], "tuned_trials": tuned["trials"],
            "tuned_seconds": round(tuned["seconds"], 1)}


def run(work: Path, only: str | None = None) -> dict[str, Any]:
    rows = {d.name: _one(work, d) for d in datasets() if only is None or d.name == only}
    gaps = [r["project_minus_lightgbm"] for r in rows.values()]
    tuned = [r["tuned_minus_lightgbm"] for r in rows.values()]
    return {"rounds": len(SEEDS), "tune_seconds": TUNE_SECONDS, "datasets": rows,
            "worst_gap_to_lightgbm": round(min(gaps), 4), "median_gap_to_lightgbm": round(statistics.median(gaps), 4),
            "worst_gap_to_best_reference": round(min(r["project_minus_best_reference"] for r in rows.values()), 4),
            "worst_tuned_gap_to_lightgbm": round(min(tuned), 4),
            "worst_tuned_minus_defaults": round(min(r["tuned_minus_defaults_split_0"] for r in rows.values()), 4)}
