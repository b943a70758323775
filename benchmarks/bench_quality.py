"""Model quality against the models users would otherwise train, on datasets that installed
packages ship (nothing is downloaded): scikit-learn's diabetes, breast_cancer, wine and digits,
statsmodels' randhie and fair, and the project's demo (whose Bayes-optimal AUC is known).

For each dataset, on the same train/validation/test split (read back from the packed shards):
the project with its defaults (only the data keys set), the same with
`model.numeric_embedding: periodic`, LightGBM with its defaults (on the
train split; categories as LightGBM categoricals), and a linear model (ridge or logistic
regression on standardised numerics and one-hot categories). The figure is the test metric of
each (R² for regression, AUC for binary, accuracy for multiclass) and the project's gap to
LightGBM, with each one's fit time.
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
    from training.data.features import FeatureStats
    from training.data.loader import ShardBatches, iter_split
    from training.data.manifest import require_manifest

    dataset_dir = Path(job.dataset_dir)
    stats = FeatureStats.from_json(Path(job.stats_path).read_text())
    out = {}
    for split in ("train", "validation", "test"):
        batches = ShardBatches(dataset_dir, require_manifest(dataset_dir), split, 4096, stats.transformer(),
                               shuffle=False, drop_last=False)
        parts = list(iter_split(batches))
        out[split] = tuple(np.concatenate([p[k].numpy() for p in parts]) for k in ("num", "cat", "label"))
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
    from sklearn.linear_model import LogisticRegression, Ridge

    (num, cat, y), (num_t, cat_t, y_t) = splits["train"], splits["test"]
    x, x_t = np.concatenate([num, cat], axis=1), np.concatenate([num_t, cat_t], axis=1)
    categorical = list(range(num.shape[1], x.shape[1]))
    out = {}
    t0 = time.perf_counter()
    if task == "regression":
        gbm = lightgbm.LGBMRegressor(verbose=-1).fit(x, y, categorical_feature=categorical)
        pred = gbm.predict(x_t)
    else:
        gbm = lightgbm.LGBMClassifier(verbose=-1).fit(x, y, categorical_feature=categorical)
        proba = gbm.predict_proba(x_t)
        pred = proba[:, 1] if task == "binary" else gbm.classes_[proba.argmax(axis=1)]
    out["lightgbm"] = {"metric": _score(task, y_t, pred), "seconds": time.perf_counter() - t0}
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


def _one(work: Path, data: Dataset) -> dict[str, Any]:
    from training.data.features import FeatureStats
    from training.data.manifest import require_manifest
    from training.model.evaluation import evaluate_package
    from training.trainer.run import train

    source = data.write(work / f"{data.name}.parquet")
    overrides = [f"data.source={source}", f"data.task={data.task}", f"data.label={data.label}",
                 f"data.numeric={data.numeric}", f"data.categorical={data.categorical}"]
    metric = METRIC[data.task]
    job = train_job(work / data.name, "defaults", overrides)
    t0 = time.perf_counter()
    result = train(job)
    seconds = time.perf_counter() - t0
    scores = evaluate_package(Path(job.run_dir) / "model", Path(job.dataset_dir),
                              require_manifest(Path(job.dataset_dir)), None)
    periodic_job = train_job(work / data.name, "periodic", [*overrides, "model.numeric_embedding=periodic"])
    train(periodic_job)
    periodic = evaluate_package(Path(periodic_job.run_dir) / "model", Path(periodic_job.dataset_dir),
                                require_manifest(Path(periodic_job.dataset_dir)), None)[metric]
    stats = FeatureStats.from_json(Path(job.stats_path).read_text())
    references = _references(data.task, _splits(job), stats.cardinalities)
    project = scores[metric]
    return {"task": data.task, "metric": metric, "test_rows": scores["rows"], "project": round(project, 4),
            "project_periodic": round(periodic, 4), "project_steps": result.steps,
            "project_seconds": round(seconds, 2),
            **{f"{k}": round(v["metric"], 4) for k, v in references.items()},
            **{f"{k}_seconds": round(v["seconds"], 2) for k, v in references.items()},
            "project_minus_lightgbm": round(project - references["lightgbm"]["metric"], 4),
            **({"target_transform": stats.target_transform} if data.task == "regression" else {})}


def run(work: Path, only: str | None = None) -> dict[str, Any]:
    rows = {d.name: _one(work, d) for d in datasets() if only is None or d.name == only}
    gaps = [r["project_minus_lightgbm"] for r in rows.values()]
    # One round: training is seeded and deterministic, and every model scores the same test rows.
    return {"rounds": 1, "datasets": rows, "worst_gap_to_lightgbm": round(min(gaps), 4),
            "median_gap_to_lightgbm": round(statistics.median(gaps), 4)}
