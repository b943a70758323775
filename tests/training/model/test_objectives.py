"""Multiclass and regression, and vector columns: trained end to end in-process, scored against
a simple scikit-learn reference on the same split, resumed bit-identically, and refused with one
clear line on bad labels or vectors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.training.helpers import assert_resumes_bit_identically, assert_resumes_bit_identically_after_a_sigkill, make_job
from training.data.ingest.packing import pack_local
from training.config import RetrainConfig, load_config
from training.data.prepare.features import FeatureStats
from training.data.load.loader import ShardBatches, iter_split
from training.data.manifest import require_manifest
from training.errors import ConfigError, DataError
from training.model.evaluation import evaluate_package
from training.trainer.run import train
from training.protocol.results import TrainResult

MULTICLASS = ["data.task=multiclass", "data.label=segment", "data.vector=[embedding]"]
REGRESSION = ["data.task=regression", "data.label=basket_value"]


def _config(small_config: RetrainConfig, extra: list[str]) -> RetrainConfig:
    raw = small_config.model_dump(mode="json")
    config = load_config(overrides=[f"storage.root={raw['storage']['root']}", f"data.source={raw['data']['source']}",
                                    "data.rows_per_member=256", "data.shard_size_mb=0.06", "train.batch_size=128",
                                    "train.eval_every=50", "train.checkpoint.every=50", "train.schedule.warmup_steps=10",
                                    "train.loader.num_workers=0", "train.max_steps=800", "model.hidden=[64, 32]",
                                    "model.embedding_dim=4", *extra])
    return config


def _split_arrays(job_dataset: str, stats: FeatureStats, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(features, label) of a split as the model sees them: standardised numerics, one-hot
    categories, vectors."""
    dataset_dir = Path(job_dataset)
    batches = ShardBatches(dataset_dir, require_manifest(dataset_dir), split, 4096, stats.transformer(),
                           shuffle=False, drop_last=False)
    parts = list(iter_split(batches))
    columns = [np.concatenate([p["num"].numpy() for p in parts])]
    cat = np.concatenate([p["cat"].numpy() for p in parts])
    for j, card in enumerate(stats.cardinalities):
        columns.append(np.eye(card, dtype=np.float32)[cat[:, j]])
    if stats.vector:
        columns.append(np.concatenate([p["vec"].numpy() for p in parts]))
    return np.concatenate(columns, axis=1), np.concatenate([p["label"].numpy() for p in parts])


def _reference(config: RetrainConfig) -> tuple[TrainResult, dict[str, float], np.ndarray, np.ndarray,
                                               np.ndarray, np.ndarray]:
    job = make_job(config)
    result = train(job)
    stats = FeatureStats.from_json(Path(job.stats_path).read_text())
    ours = evaluate_package(Path(job.run_dir) / "model", Path(job.dataset_dir), require_manifest(Path(job.dataset_dir)),
                            None)
    x_train, y_train = _split_arrays(job.dataset_dir, stats, "train")
    x_test, y_test = _split_arrays(job.dataset_dir, stats, "test")
    return result, ours, x_train, y_train, x_test, y_test


def test_multiclass_with_string_classes_and_a_vector_column_matches_logistic_regression(
        small_config: RetrainConfig) -> None:
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import accuracy_score, f1_score, log_loss

    config = _config(small_config, MULTICLASS)
    result, ours, x_train, y_train, x_test, y_test = _reference(config)
    manifest = require_manifest(Path(make_job(config).dataset_dir))
    assert manifest.classes == ["bargain", "mainstream", "niche", "premium"]  # sorted, from the train split
    assert result.metric == "accuracy" and result.best_val_auc is None
    assert {"accuracy", "macro_f1", "logloss"} <= result.history[-1].metrics.keys()
    reference = LogisticRegression(max_iter=2000).fit(x_train, y_train)
    prob = reference.predict_proba(x_test)
    baseline = {"accuracy": accuracy_score(y_test, prob.argmax(1)),
                "macro_f1": f1_score(y_test, prob.argmax(1), average="macro"), "logloss": log_loss(y_test, prob)}
    print(f"\nmulticlass (demo segment, {len(y_test)} test rows): ours {ours}, logistic regression {baseline}")
    # At the reference's level: 823 test rows put about 1.5 points of noise on accuracy.
    assert ours["accuracy"] >= baseline["accuracy"] - 0.03
    assert ours["logloss"] <= baseline["logloss"] * 1.05


def test_regression_predicts_in_label_units_and_matches_ridge(small_config: RetrainConfig) -> None:
    from sklearn.linear_model import Ridge
    from sklearn.metrics import mean_absolute_error, r2_score, root_mean_squared_error

    config = _config(small_config, REGRESSION)
    result, ours, x_train, y_train, x_test, y_test = _reference(config)
    assert result.metric == "rmse" and {"rmse", "mae", "r2"} <= result.history[-1].metrics.keys()
    pred = Ridge(alpha=1.0).fit(x_train, y_train).predict(x_test)
    baseline = {"rmse": root_mean_squared_error(y_test, pred), "mae": mean_absolute_error(y_test, pred),
                "r2": r2_score(y_test, pred)}
    print(f"\nregression (demo basket_value, {len(y_test)} test rows): ours {ours}, ridge {baseline}")
    assert ours["rmse"] <= baseline["rmse"] * 1.05  # in dollars, like the label
    assert ours["r2"] > 0.5


@pytest.mark.parametrize("extra", [MULTICLASS, REGRESSION], ids=["multiclass", "regression"])
def test_each_task_resumes_bit_identically(small_config: RetrainConfig, extra: list[str]) -> None:
    config = _config(small_config, extra)
    config.train.max_steps = 120
    assert_resumes_bit_identically(config)


def test_eval_metric_picks_the_direction_and_is_checked_against_the_task() -> None:
    assert load_config(overrides=[*REGRESSION, "eval.metric=mae"]).eval.metric == "mae"
    with pytest.raises(ConfigError, match="'auc' is not a regression metric"):
        load_config(overrides=[*REGRESSION, "eval.metric=auc"])
    with pytest.raises(ConfigError, match="set eval.target instead"):
        load_config(overrides=[*REGRESSION, "eval.target_auc=0.8"])


def _write(path: Path, columns: dict[str, pa.Array]) -> Path:
    pq.write_table(pa.table(columns), path)
    return path


def _bad(tmp_path: Path, overrides: list[str], columns: dict[str, pa.Array]) -> str:
    source = _write(tmp_path / "bad.parquet", {"x": pa.array(np.arange(400, dtype=np.float64)), **columns})
    config = load_config(overrides=[f"data.source={source}", "data.numeric=[x]", "data.categorical=[]", *overrides])
    with pytest.raises(DataError) as err:
        pack_local(source, config.data, tmp_path / "datasets")
    assert not list((tmp_path / "datasets").glob("**/.partial-*"))  # nothing half-written is left
    return str(err.value)


def test_an_unseen_class_names_value_and_row(tmp_path: Path) -> None:
    from training.data.ingest.segments import split_of_file

    labels = ["a", "b"] * 200
    keys = {"k": pa.array(np.arange(400))}  # data.split_key: the split does not depend on the labels
    config = load_config(overrides=["data.split_key=k"])
    split = split_of_file(_write(tmp_path / "keys.parquet", {**keys, "y": pa.array(labels)}), config.data)
    row = int(np.flatnonzero(split == 2)[0])  # a test row
    labels[row] = "zebra"
    message = _bad(tmp_path, ["data.task=multiclass", "data.label=y", "data.split_key=k"],
                   {**keys, "y": pa.array(labels)})
    assert f"value 'zebra' at row {row}" in message and "not a class of the train split" in message


def test_a_vector_of_the_wrong_length_names_column_and_row(tmp_path: Path) -> None:
    vectors = [[0.1, 0.2, 0.3]] * 400
    vectors[123] = [0.1, 0.2]
    message = _bad(tmp_path, ["data.vector=[emb]"], {"emb": pa.array(vectors, pa.list_(pa.float32())),
                                                     "clicked": pa.array([0, 1] * 200)})
    assert "vector column 'emb' has length 2 at row 123" in message


@pytest.mark.parametrize("label,expected", [
    (pa.array(["1.5"] * 400), "a regression label must be numeric"),
    (pa.array([1.0] * 399 + [float("nan")]), "has nan at row 399; a regression label must be finite"),
], ids=["non-numeric", "nan"])
def test_a_bad_regression_label_is_named(tmp_path: Path, label: pa.Array, expected: str) -> None:
    message = _bad(tmp_path, ["data.task=regression", "data.label=y"], {"y": label})
    assert "label column 'y'" in message and expected in message


def test_a_multiclass_label_of_floats_is_refused(tmp_path: Path) -> None:
    message = _bad(tmp_path, ["data.task=multiclass", "data.label=y"], {"y": pa.array([0.5, 1.5] * 200)})
    assert "a multiclass label holds integers or strings" in message


@pytest.mark.parametrize("factory", ["tests.model_factories:schema_linear", "tests.model_factories:linear"],
                         ids=["fn(schema, config)", "old fn(n_numeric, cardinalities, config)"])
def test_user_factories_of_both_forms_train_and_load_back(small_config: RetrainConfig, factory: str) -> None:
    extra = [*REGRESSION, f"model.factory={factory}"]
    config = _config(small_config, extra)
    config.train.max_steps = 40
    job = make_job(config)
    result = train(job)
    scored = evaluate_package(Path(job.run_dir) / "model", Path(job.dataset_dir),
                              require_manifest(Path(job.dataset_dir)), factory)
    assert result.steps == 40 and scored["rmse"] == pytest.approx(result.history[-1]["rmse"], rel=0.5)


def test_an_old_form_factory_cannot_take_vector_columns(small_config: RetrainConfig) -> None:
    config = _config(small_config, [*MULTICLASS, "model.factory=tests.model_factories:linear"])
    with pytest.raises(ConfigError, match="cannot see data.vector, data.text or data.image columns; write it as fn\\(schema, config\\)"):
        train(make_job(config))


@pytest.mark.slow
@pytest.mark.parametrize("extra", [MULTICLASS, REGRESSION], ids=["multiclass", "regression"])
def test_each_task_resumes_bit_identically_after_a_sigkill(small_config: RetrainConfig, extra: list[str]) -> None:
    """The real thing: the training child process killed with SIGKILL mid-run, then rerun."""
    config = _config(small_config, extra)
    config.train.max_steps, config.train.checkpoint.every = 200, 25
    assert_resumes_bit_identically_after_a_sigkill(config, 80)


def test_a_multiclass_label_of_ints_in_one_file_and_strings_in_another_names_both(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    x = pa.array(np.arange(400, dtype=np.float64))
    _write(source / "a.parquet", {"x": x, "y": pa.array([0, 1, 2, 3] * 100)})
    _write(source / "b.parquet", {"x": x, "y": pa.array(["0", "1", "2", "3"] * 100)})
    config = load_config(overrides=[f"data.source={source}", "data.numeric=[x]", "data.categorical=[]",
                                    "data.task=multiclass", "data.label=y"])
    with pytest.raises(DataError) as err:
        pack_local(source, config.data, tmp_path / "datasets")
    message = str(err.value)
    assert "int values in a.parquet and str values in b.parquet" in message and "\n" not in message
