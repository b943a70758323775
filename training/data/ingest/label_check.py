"""The label of a user's source, read before anything starts: its task inferred from its values
when `data.task` is not given, and checked against the task, so a wrong label is one line in about
a second rather than a failure minutes into packing.

The task, as AutoGluon's `TabularPredictor(label=...)` infers it:

    booleans, or numbers that are all 0 or 1     binary
    strings, or at most MAX_CLASSES integers     multiclass
    other floats, or more distinct integers      regression

Only the first file's label column is read (one column chunk per row group).
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from training.data.ingest.parquet_reader import ParquetRanges
from training.errors import DataError

__all__ = ["LabelProfile", "MAX_CLASSES", "check_label", "infer_task", "profile_label"]

MAX_CLASSES = 20  # integer labels with more distinct values are a quantity, not classes
_SHOWN = 1000  # distinct values collected at most


@dataclass(frozen=True)
class LabelProfile:
    where: str
    name: str
    type: pa.DataType
    rows: int
    nulls: int
    first_null: int | None  # its row
    distinct: list[object]  # sorted, at most _SHOWN
    many: bool  # more distinct values than `distinct` holds
    integral: bool  # numbers that are all whole

    @property
    def numeric(self) -> bool:
        return bool(pa.types.is_integer(self.type) or pa.types.is_floating(self.type))

    @property
    def text(self) -> bool:
        return bool(pa.types.is_string(self.type) or pa.types.is_large_string(self.type)
                    or pa.types.is_dictionary(self.type))


def profile_label(ranges: ParquetRanges, name: str) -> LabelProfile:
    """The label column of the source's first file: its type, nulls and distinct values."""
    column = pa.chunked_array([b.column(0) for b in ranges.parquet.iter_batches(batch_size=65_536, columns=[name])],
                              type=ranges.schema.field(name).type)
    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)
    nulls = column.null_count
    first_null = int(pc.index(column.is_null(), True).as_py()) if nulls else None
    present = column.drop_null()
    unique = pc.unique(present)
    many = len(unique) > _SHOWN
    values = sorted(unique.slice(0, _SHOWN).to_pylist(), key=lambda v: (str(type(v)), v))
    integral = False
    if (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)) and len(present):
        floats = pc.cast(present, pa.float64())
        integral = bool(pc.all(pc.equal(floats, pc.floor(floats))).as_py())
    return LabelProfile(ranges.where, name, column.type, len(column), nulls, first_null, values, many, integral)


def infer_task(label: LabelProfile) -> tuple[str, str]:
    """(the task, why) for a label whose task was not given."""
    n = "more than 1000" if label.many else str(len(label.distinct))
    if pa.types.is_boolean(label.type):
        return "binary", "its values are booleans"
    if label.numeric and not label.many and set(label.distinct) <= {0, 1} and len(label.distinct) == 2:
        return "binary", "its values are 0 and 1"
    if label.text:
        return "multiclass", f"it holds text ({n} distinct values)"
    if pa.types.is_integer(label.type) and not label.many and len(label.distinct) <= MAX_CLASSES:
        return "multiclass", f"it holds {n} distinct integers"
    if label.numeric:
        kind = "integers" if pa.types.is_integer(label.type) else "numbers"
        return "regression", f"it holds {n} distinct {kind}"
    raise DataError(f"{label.where}: label column '{label.name}' has type {label.type}; a label holds numbers, "
                    "booleans or strings")


def check_label(label: LabelProfile, task: str, drop_null_labels: bool) -> None:
    """One DataError when the label cannot be learned as `task`."""
    where, name = label.where, label.name
    if label.rows and label.nulls == label.rows:
        raise DataError(f"{where}: label column '{name}' is null in every row ({label.rows}); choose another "
                        "data.label")
    if label.nulls and not drop_null_labels:
        raise DataError(f"{where}: label column '{name}' is null in {label.nulls} of {label.rows} rows, the first at "
                        f"row {label.first_null}; fill them, or leave those rows out with --set data.drop_null_labels=true")
    other = infer_task(label)[0]
    hint = f" (its values suggest --set data.task={other})" if other != task else ""
    if task == "binary":
        if not (label.numeric or pa.types.is_boolean(label.type)):
            raise DataError(f"{where}: label column '{name}' has type {label.type}; a binary label is 0/1{hint}")
        bad = [v for v in label.distinct if v not in (0, 1)]
        if bad or label.many:
            shown = bad[0] if bad else "many values"
            raise DataError(f"{where}: label column '{name}' must be 0 or 1 for data.task binary, found {shown!r}{hint}")
    elif task == "multiclass":
        if not (pa.types.is_integer(label.type) or label.text):
            raise DataError(f"{where}: label column '{name}' has type {label.type}; a multiclass label holds integers "
                            f"or strings{hint}")
        if len(label.distinct) < 2:
            raise DataError(f"{where}: label column '{name}' has {len(label.distinct)} class(es); multiclass needs at "
                            "least 2")
    elif task == "regression" and not label.numeric:
        raise DataError(f"{where}: label column '{name}' has type {label.type}; a regression label is a number{hint}")
