"""The label of a user's source, read before anything starts: the task inferred from its values
when data.task is not given, and a label that cannot be learned is one line naming it."""

from __future__ import annotations

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
