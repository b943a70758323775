"""The label column per task, at pack time: what values are valid, how they are stored in the
shards, and what every split must hold.

One small class per task (`data.task`), found in `LABELS`; a new task is a new entry here and
one in `training.model.objectives` (its loss, predictions and metrics), not a branch through the packer.

    binary       0/1 (integer, float or boolean),  stored as float32 0.0/1.0
                 or two values named by data.positive and data.negative
    multiclass   integers or strings               stored as int64 index into `classes`
    regression   any finite number                 stored as float32 in the label's own units

The classes of a multiclass label are the sorted distinct values of the train split. Each
segment stores its own codes (`SegmentClasses`), which the dataset maps to its classes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from training.data.manifest import Classes
from training.errors import DataError

__all__ = ["LABELS", "LabelCodec", "Classes", "SegmentClasses"]



def _first_null(path: str | Path, name: str, col: pa.Array, first_row: int) -> None:
    if col.null_count:
        i = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
        raise DataError(f"{path}: label column '{name}' is null at row {first_row + i}")


def _is_number(col: pa.Array) -> bool:
    return pa.types.is_integer(col.type) or pa.types.is_floating(col.type) or pa.types.is_boolean(col.type)


class LabelCodec:
    """Validates and encodes one task's label column."""

    task: ClassVar[str]
    dtype: ClassVar[type]

    def encode(self, path: str | Path, name: str, col: pa.Array, first_row: int, classes: Classes,
               two: tuple[Any, Any] | None = None) -> np.ndarray:
        """The column's labels as stored; `two`: (positive, negative) of a binary label of two
        values other than 0/1."""
        raise NotImplementedError

    def check_splits(self, source: Path, name: str, rows: dict[str, int], positives: dict[str, int],
                     classes: Classes) -> None:
        """Raise a DataError when the packed splits cannot train or evaluate this task."""

    def counts_positives(self) -> bool:
        return False


class BinaryLabels(LabelCodec):
    task, dtype = "binary", np.float32

    def encode(self, path: str | Path, name: str, col: pa.Array, first_row: int, classes: Classes,
               two: tuple[Any, Any] | None = None) -> np.ndarray:
        if two is not None:
            return _two_values(path, name, col, first_row, two)
        if not _is_number(col):
            raise DataError(f"{path}: label column '{name}' has type {col.type}, expected 0/1 integers "
                            "(for other labels set data.task: multiclass or regression)")
        _first_null(path, name, col, first_row)
        values = pc.cast(col, pa.float64()).to_numpy(zero_copy_only=False)
        bad = ~((values == 0) | (values == 1))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise DataError(f"{path}: label column '{name}' must be 0 or 1, found {float(values[i])!r} at row "
                            f"{first_row + i} (for other labels set data.task: multiclass or regression)")
        return values.astype(np.float32)

    def counts_positives(self) -> bool:
        return True

    def check_splits(self, source: Path, name: str, rows: dict[str, int], positives: dict[str, int],
                     classes: Classes) -> None:
        total, total_pos = sum(rows.values()), sum(positives.values())
        if total_pos in (0, total):
            raise DataError(f"{source}: label column '{name}' has only class {1 if total_pos else 0}; "
                            "training needs both 0 and 1")
        train, train_positives = rows["train"], positives["train"]
        if train and train_positives in (0, train):  # an empty split has its own error
            raise DataError(f"{source}: the train split of label '{name}' has a single class; add rows")


class MulticlassLabels(LabelCodec):
    task, dtype = "multiclass", np.int64

    @staticmethod
    def check_type(path: str | Path, name: str, col_type: pa.DataType) -> None:
        if not (pa.types.is_integer(col_type) or pa.types.is_string(col_type) or pa.types.is_large_string(col_type)
                or pa.types.is_dictionary(col_type)):
            raise DataError(f"{path}: label column '{name}' has type {col_type}; a multiclass label holds integers "
                            "or strings")

    def encode(self, path: str | Path, name: str, col: pa.Array, first_row: int, classes: Classes,
               two: tuple[Any, Any] | None = None) -> np.ndarray:
        self.check_type(path, name, col.type)
        _first_null(path, name, col, first_row)
        if pa.types.is_dictionary(col.type):
            col = col.cast(col.type.value_type)
        found = pc.index_in(col, value_set=pa.array(classes, type=col.type))
        if found.null_count:
            i = int(np.flatnonzero(found.is_null().to_numpy(zero_copy_only=False))[0])
            raise DataError(f"{path}: label column '{name}' has value {col[i].as_py()!r} at row {first_row + i}, "
                            f"which is not a class of the train split ({_show(classes)}); add train rows "
                            "with it or drop the row")
        return found.to_numpy(zero_copy_only=False).astype(np.int64)

    def check_splits(self, source: Path, name: str, rows: dict[str, int], positives: dict[str, int],
                     classes: Classes) -> None:
        if len(classes) < 2:
            raise DataError(f"{source}: the train split of label '{name}' has {len(classes)} class(es) "
                            f"({_show(classes)}); multiclass training needs at least 2")


class RegressionLabels(LabelCodec):
    task, dtype = "regression", np.float32

    def encode(self, path: str | Path, name: str, col: pa.Array, first_row: int, classes: Classes,
               two: tuple[Any, Any] | None = None) -> np.ndarray:
        if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type) or pa.types.is_decimal(col.type)):
            raise DataError(f"{path}: label column '{name}' has type {col.type}; a regression label must be numeric")
        _first_null(path, name, col, first_row)
        values = pc.cast(col, pa.float64()).to_numpy(zero_copy_only=False)
        bad = ~np.isfinite(values)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise DataError(f"{path}: label column '{name}' has {float(values[i])!r} at row {first_row + i}; "
                            "a regression label must be finite")
        return values.astype(np.float32)


def _two_values(path: str | Path, name: str, col: pa.Array, first_row: int, two: tuple[Any, Any]) -> np.ndarray:
    """1.0 where the label is the positive class, 0.0 where it is the negative; a third value
    is an error naming its row (a stray, never a new class)."""
    _first_null(path, name, col, first_row)
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    positive, negative = two
    values = col.to_pylist()
    if pa.types.is_floating(col.type) or pa.types.is_integer(col.type):
        values = [int(v) if float(v).is_integer() else v for v in values]
    is_positive = np.fromiter((v == positive for v in values), dtype=bool, count=len(values))
    stray = ~is_positive & ~np.fromiter((v == negative for v in values), dtype=bool, count=len(values))
    if stray.any():
        i = int(np.flatnonzero(stray)[0])
        raise DataError(f"{path}: label column '{name}' has {values[i]!r} at row {first_row + i}, neither of its two "
                        f"classes {positive!r} (data.positive) and {negative!r} (data.negative); fix or drop the "
                        "row, or set data.task: multiclass")
    return is_positive.astype(np.float32)


LABELS: dict[str, LabelCodec] = {c.task: c for c in (BinaryLabels(), MulticlassLabels(), RegressionLabels())}


def _show(classes: Classes, limit: int = 10) -> str:
    shown = ", ".join(repr(c) for c in classes[:limit])
    return shown + (f", ... ({len(classes)} in all)" if len(classes) > limit else "")


class SegmentClasses:
    """A multiclass label coded within one segment: code i is the i-th distinct value in the
    order the segment's rows first show it. The dataset maps codes to its classes (the sorted
    distinct values of the train split, over every segment), so a segment never depends on the
    others and is packed once."""

    def __init__(self) -> None:
        self.values: list[Any] = []
        self.first_rows: list[int] = []  # the file row where each value first appears
        self._index: dict[Any, int] = {}

    def encode(self, path: str, name: str, col: pa.Array, first_row: int) -> np.ndarray:
        MulticlassLabels.check_type(path, name, col.type)
        _first_null(path, name, col, first_row)
        if pa.types.is_dictionary(col.type):
            col = col.cast(col.type.value_type)
        for value in pc.unique(col).to_pylist():  # in order of first appearance
            if value not in self._index:
                kind = type(value)
                if self.values and kind is not type(self.values[0]):
                    raise DataError(f"{path}: label column '{name}' holds both {type(self.values[0]).__name__} and "
                                    f"{kind.__name__} values; a multiclass label holds integers or strings")
                self._index[value] = len(self.values)
                self.values.append(value)
                self.first_rows.append(first_row + pc.index(col, value).as_py())
        found = pc.index_in(col, value_set=pa.array(self.values, type=col.type))
        return found.to_numpy(zero_copy_only=False).astype(np.int64)
