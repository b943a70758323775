"""The label of a user's source, read before anything starts: the task inferred from its values
when data.task is not given, and a label that cannot be learned is one line naming it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from training.config import load_config
from training.data.ingest.source_check import checked_source
from training.errors import DataError


def _source(tmp_path: Path, label: list, name: str = "y") -> Path:
    rng = np.random.default_rng(0)
    n = len(label)
    path = tmp_path / "mine.parquet"
    pq.write_table(pa.table({"x1": rng.normal(size=n), "shop": rng.choice(["a", "b"], size=n), name: label}), path)
    return path


def _checked(source: Path, label: str = "y", *extra: str):  # type: ignore[no-untyped-def]
    return checked_source(load_config(overrides=[f"data.source={source}", f"data.label={label}",
                                                 f"storage.root={source.parent / 'root'}", *extra]))


@pytest.mark.parametrize(("values", "task"), [
    ([0.5, 1.25, 3.0, 7.5] * 50, "regression"),
    (list(range(200)), "regression"),  # many distinct integers: a quantity
    ([0, 1, 2] * 60, "multiclass"),
    (["red", "green", "blue"] * 60, "multiclass"),
    ([0, 1] * 100, "binary"),
    ([0.0, 1.0] * 100, "binary"),
    ([True, False] * 100, "binary"),
])
def test_the_task_is_inferred_from_the_labels_values(tmp_path: Path, values: list, task: str) -> None:
    config, inferred = _checked(_source(tmp_path, values))
    assert config.data.task == task and inferred is not None and inferred.task == task
    assert f"data.task={task}" in inferred.overrides()[0] and inferred.task_why


def test_a_label_named_like_a_demo_column_and_a_partial_feature_list_inherit_nothing_from_the_demo(
        tmp_path: Path) -> None:
    config, _ = _checked(_source(tmp_path, [3.5, 9.0, 1.0, 4.0] * 50, name="price"), "price")
    assert config.data.task == "regression" and "price" not in config.data.numeric
    named, _ = _checked(_source(tmp_path, [0, 1] * 100), "y", "data.numeric=[x1]")
    assert named.data.numeric == ["x1"] and named.data.categorical == []  # not the demo's list
    # The text demo named with its own column: not the tabular demo's numeric and categorical.
    reviews, _ = checked_source(load_config(overrides=["data.source=demo:reviews", "data.label=positive",
                                                       "data.text=[review]", f"storage.root={tmp_path / 'r'}"]))
    assert reviews.data.text == ["review"] and reviews.data.numeric == [] and reviews.data.categorical == []


def test_a_given_task_is_kept_and_a_label_that_does_not_fit_it_is_one_line(tmp_path: Path) -> None:
    source = _source(tmp_path, [0.5, 1.25, 3.0, 7.5] * 50)
    with pytest.raises(DataError, match=r"label column 'y' must be 0 or 1 for data.task binary, found 0.5 \(its "
                                        r"values suggest --set data.task=regression\)"):
        _checked(source, "y", "data.task=binary")
    with pytest.raises(DataError, match=r"label column 'y' has type string; a regression label is a number"):
        _checked(_source(tmp_path, ["a", "b"] * 50), "y", "data.task=regression")


def test_null_labels_are_one_line_or_left_out_on_request(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"label column 'y' is null in every row \(100\)"):
        _checked(_source(tmp_path, pa.array([None] * 100, pa.float64())))
    some = _source(tmp_path, [0, 1, None, 1] * 25)
    with pytest.raises(DataError, match=r"label column 'y' is null in 25 of 100 rows, the first at row 2; .*"
                                        r"--set data.drop_null_labels=true"):
        _checked(some)
    config, _ = _checked(some, "y", "data.drop_null_labels=true")
    assert config.data.task == "binary"


def test_rows_with_a_null_label_are_left_out_of_the_packed_data(tmp_path: Path) -> None:
    from tests.conftest import small_overrides
    from training.pipeline.pack_stage import pack_stage

    rng = np.random.default_rng(1)
    labels = rng.integers(0, 2, size=3000).astype(float)
    labels[::10] = np.nan
    path = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"x1": rng.normal(size=3000), "y": pa.array(labels, from_pandas=True)}), path)
    config = load_config(overrides=[*small_overrides(tmp_path / "root", path), "data.label=y", "data.task=binary",
                                    "data.numeric=[x1]", "data.categorical=[]", "data.drop_null_labels=true"])
    packed = pack_stage(config)
    assert sum(packed.rows.values()) == 3000 - 300
    # Counted where the run reports it, and again when the dataset is reused from the root.
    assert packed.dropped_null_labels == 300
    again = pack_stage(config)
    assert again.reused and again.dropped_null_labels == 300


def test_the_task_is_read_from_the_whole_folder_not_its_first_file(tmp_path: Path) -> None:
    """Daily files, the first days quiet: the first files hold one class of a 0/1 label, the
    folder both. Binary, not an error about the first file."""
    folder = tmp_path / "daily"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for day in range(10):
        y = np.zeros(200, dtype=np.int64) if day < 6 else rng.integers(0, 2, size=200)
        pq.write_table(pa.table({"x1": rng.normal(size=200), "y": y}), folder / f"day-{day:02d}.parquet")
    config, inferred = _checked(folder)
    assert config.data.task == "binary" and inferred is not None and inferred.task == "binary"


def test_a_label_of_numbers_in_one_file_and_words_in_another_is_one_line_before_packing(tmp_path: Path) -> None:
    folder = tmp_path / "mixed"
    folder.mkdir()
    pq.write_table(pa.table({"x1": [0.1, 0.2], "y": [0, 1]}), folder / "a.parquet")
    pq.write_table(pa.table({"x1": [0.1, 0.2], "y": ["no", "yes"]}), folder / "b.parquet")
    with pytest.raises(DataError, match=r"label column 'y' holds numbers in .*a.parquet and strings in .*b.parquet"):
        _checked(folder)


def test_a_file_with_no_rows_says_so(tmp_path: Path) -> None:
    path = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"x1": pa.array([], pa.float64()), "y": pa.array([], pa.int64())}), path)
    with pytest.raises(DataError, match=r"empty.parquet: the file has no rows"):
        _checked(path)


@pytest.mark.parametrize(("values", "positive"), [(["benign"] * 150 + ["malignant"] * 50, "malignant"),
                                                    (["no"] * 100 + ["yes"] * 100, "yes"),  # a tie: the later
                                                    ([1] * 60 + [2] * 140, 1)])
def test_two_values_of_any_type_are_binary_with_the_rarer_positive(tmp_path: Path, values: list,
                                                                   positive: object) -> None:
    config, inferred = _checked(_source(tmp_path, values))
    assert config.data.task == "binary" and config.data.positive == positive
    assert inferred is not None and repr(positive) in inferred.task_why
    named, _ = _checked(_source(tmp_path, values), "y", f"data.positive={json.dumps(values[0])}")
    assert named.data.positive == values[0] and named.data.negative != values[0]
    with pytest.raises(DataError, match=r"data.positive 'maybe' is not one of label 'y''s two values"):
        _checked(_source(tmp_path, values), "y", "data.positive=maybe")


def test_a_yes_no_label_trains_binary_with_auc_and_a_stray_is_an_error(tmp_path: Path) -> None:
    """Packed and trained: the positive class is stored as 1, the model has AUC; a third value
    in the data is one error naming its row, never a third class."""
    from tests.conftest import small_overrides
    from tests.training.helpers import make_job
    from training.trainer.run import train

    rng = np.random.default_rng(2)
    x = rng.normal(size=4000)
    y = np.where(x + rng.normal(scale=0.5, size=4000) > 0.8, "churned", "stayed")
    path = tmp_path / "churn.parquet"
    pq.write_table(pa.table({"x1": x, "y": y}), path)
    config, _ = checked_source(load_config(overrides=[*small_overrides(tmp_path / "root", path), "data.label=y"]))
    assert (config.data.task, config.data.positive, config.data.negative) == ("binary", "churned", "stayed")
    result = train(make_job(config))
    assert "auc" in result.history[-1].metrics and result.best_val_metric is not None
    assert result.metric == "auc" and result.best_val_metric > 0.85

    y[1234] = "maybe"
    stray = tmp_path / "stray.parquet"
    pq.write_table(pa.table({"x1": x, "y": y}), stray)
    from training.pipeline.pack_stage import pack_stage

    with pytest.raises(DataError, match=r"label column 'y' has 'maybe' at row 1234, neither of its two classes"):
        pack_stage(config.with_values({"data.source": str(stray)}, "test"))


def test_a_date_feeds_its_parts_and_learns_what_its_weekday_column_would(tmp_path: Path) -> None:
    """The label depends on the weekday alone. Inferred from the schema, the timestamp column
    becomes data.dates and trains as well as the same table with the weekday given as a number;
    data.dates=[] leaves it out (and then nothing can be learned)."""
    from tests.conftest import small_overrides
    from tests.training.helpers import make_job
    from training.trainer.run import train

    rng = np.random.default_rng(3)
    n = 6000
    when = np.datetime64("2024-01-01T00:00", "s") + rng.integers(0, 730 * 86400, size=n).astype("timedelta64[s]")
    weekday = ((when.astype("datetime64[D]").astype(np.int64) + 3) % 7)  # 1970-01-01 was a Thursday
    y = ((weekday >= 5) ^ (rng.random(n) < 0.05)).astype(np.int64)
    noise = rng.normal(size=n)
    dated = tmp_path / "dated.parquet"
    pq.write_table(pa.table({"noise": noise, "when": pa.array(when, pa.timestamp("s", tz="UTC")), "y": y}), dated)
    numbered = tmp_path / "numbered.parquet"
    pq.write_table(pa.table({"noise": noise, "weekday": weekday.astype(np.float64), "y": y}), numbered)

    def trained(path: Path, *extra: str) -> float:
        config, inferred = checked_source(load_config(overrides=[
            *small_overrides(tmp_path / f"root-{path.stem}-{len(extra)}", path), "data.label=y", "train.max_steps=150",
            *extra]))
        if path == dated and not extra:
            assert config.data.dates == ["when"] and inferred is not None and "data.dates=[when]" in " ".join(
                inferred.overrides()) and inferred.notes
        return float(train(make_job(config)).best_val_metric)

    with_date, with_weekday = trained(dated), trained(numbered)
    assert with_weekday > 0.9 and with_date >= with_weekday - 0.02
    config, _ = checked_source(load_config(overrides=[*small_overrides(tmp_path / "root-none", dated), "data.label=y",
                                                      "data.dates=[]", "data.numeric=[noise]"]))
    assert config.data.dates == [] and config.data.numeric_features == ["noise"]


@pytest.mark.parametrize("count", [-1, "300", 2.5, True])
def test_a_dataset_manifest_whose_dropped_count_is_not_a_row_count_is_refused(tmp_path: Path, count: object) -> None:
    import json

    from tests.conftest import small_overrides
    from training.data.manifest import DatasetManifest
    from training.pipeline.pack_stage import pack_stage

    rng = np.random.default_rng(1)
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"x1": rng.normal(size=500), "y": rng.integers(0, 2, size=500)}), path)
    packed = pack_stage(load_config(overrides=[*small_overrides(tmp_path / "root", path), "data.label=y",
                                               "data.numeric=[x1]", "data.categorical=[]"]))
    raw = json.loads((Path(packed.dataset_dir) / "manifest.json").read_text())
    raw["segments"][0]["dropped_null_labels"] = count
    with pytest.raises(DataError, match="dropped_null_labels that is not a row count"):
        DatasetManifest.from_json(json.dumps(raw))
