"""The label of a user's source, read before anything starts: its task inferred from its values
when `data.task` is not given, and checked against the task, so a wrong label is one line in about
a second rather than a failure minutes into packing.

The task, as AutoGluon's `TabularPredictor(label=...)` infers it:

    booleans, or exactly two values of any type  binary (the positive class: the rarer, or data.positive)
    strings, or at most MAX_CLASSES integers     multiclass
    other floats, or more distinct integers      regression

The label column is read from the source as a whole, not from its first file: a folder of daily
files whose first days hold one class is still binary. Up to SAMPLED_FILES files are read, evenly
spread over the source's order (the first and the last among them), one column chunk per row
group each.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from training.data.ingest.parquet_reader import ParquetRanges
from training.errors import DataError

__all__ = ["LabelProfile", "MAX_CLASSES", "SAMPLED_FILES", "check_label", "infer_task", "merge_profiles",
           "positive_class", "profile_label"]

MAX_CLASSES = 20  # integer labels with more distinct values are a quantity, not classes
SAMPLED_FILES = 8  # files of a source whose label column the check reads (see the module docstring)
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
    counts: tuple[int, ...] = ()  # rows of each of `distinct`, where not `many`

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
    tally = pc.value_counts(present)
    many = len(tally) > _SHOWN
    pairs = sorted(zip(tally.field("values").to_pylist(), tally.field("counts").to_pylist(), strict=True),
                   key=lambda vc: (str(type(vc[0])), vc[0]))[:_SHOWN]
    integral = False
    if (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)) and len(present):
        floats = pc.cast(present, pa.float64())
        integral = bool(pc.all(pc.equal(floats, pc.floor(floats))).as_py())
    if not len(column):
        raise DataError(f"{ranges.where}: the file has no rows")
    return LabelProfile(ranges.where, name, column.type, len(column), nulls, first_null, [v for v, _ in pairs], many,
                        integral, () if many else tuple(int(c) for _, c in pairs))


def _kind(t: pa.DataType) -> str:
    if pa.types.is_boolean(t):
        return "booleans"
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        return "numbers"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_dictionary(t):
        return "strings"
    return str(t)


def merge_profiles(where: str, profiles: list[LabelProfile]) -> LabelProfile:
    """One profile of the label over several files of a source (`where`): rows, nulls and
    values summed; a label that holds numbers in one file and strings in another is one error
    naming both, before anything is packed."""
    first = profiles[0]
    for other in profiles[1:]:
        if _kind(other.type) != _kind(first.type):
            raise DataError(f"{where}: label column '{first.name}' holds {_kind(first.type)} in {first.where} and "
                            f"{_kind(other.type)} in {other.where}; a label holds one kind of value in every file")
    if len(profiles) == 1:
        return first
    counts: dict[object, int] = {}
    many = any(p.many for p in profiles)
    for p in profiles:
        for i, value in enumerate(p.distinct):
            counts[value] = counts.get(value, 0) + (p.counts[i] if p.counts else 0)
    values = sorted(counts, key=lambda v: (str(type(v)), v))
    many = many or len(values) > _SHOWN
    values = values[:_SHOWN]
    nulls = sum(p.nulls for p in profiles)
    at = next((p for p in profiles if p.first_null is not None), None)
    wide = next((p.type for p in profiles if pa.types.is_floating(p.type)), first.type)
    return LabelProfile(where if at is None else at.where, first.name, wide, sum(p.rows for p in profiles), nulls,
                        None if at is None or at.first_null is None else at.first_null, values, many,
                        all(p.integral for p in profiles if p.rows - p.nulls),
                        () if many else tuple(counts[v] for v in values))


def positive_class(label: LabelProfile, named: object = None) -> tuple[object, object]:
    """(positive, negative) of a label with two values: `named` (data.positive) where given,
    else the rarer of the two (the one a model is usually asked to find: churned, fraud,
    malignant); a tie goes to the one that sorts last ("yes" over "no")."""
    a, b = label.distinct
    if named is not None:
        if named not in (a, b):
            raise DataError(f"{label.where}: data.positive {named!r} is not one of label '{label.name}''s two "
                            f"values, {a!r} and {b!r}; name one of them (quote a word YAML reads as a boolean: "
                            f"--set data.positive='\"yes\"')")
        return named, b if named == a else a
    count_a, count_b = label.counts if len(label.counts) == 2 else (0, 0)
    positive = a if count_a < count_b else b
    return positive, b if positive == a else a


def infer_task(label: LabelProfile) -> tuple[str, str]:
    """(the task, why) for a label whose task was not given."""
    n = "more than 1000" if label.many else str(len(label.distinct))
    if pa.types.is_boolean(label.type):
        return "binary", "its values are booleans"
    if label.numeric and not label.many and set(label.distinct) <= {0, 1} and len(label.distinct) == 2:
        return "binary", "its values are 0 and 1"
    if not label.many and len(label.distinct) == 2 and (label.text or label.integral):
        positive, negative = positive_class(label)
        return "binary", (f"it holds two values; the positive class is {positive!r}, the rarer (set "
                          f"data.positive to choose {negative!r})")
    if label.text:
        return "multiclass", f"it holds text ({n} distinct values)"
    if pa.types.is_integer(label.type) and not label.many and len(label.distinct) <= MAX_CLASSES:
        return "multiclass", f"it holds {n} distinct integers"
    if label.numeric:
        kind = "integers" if pa.types.is_integer(label.type) else "numbers"
        return "regression", f"it holds {n} distinct {kind}"
    raise DataError(f"{label.where}: label column '{label.name}' has type {label.type}; a label holds numbers, "
                    "booleans or strings")


def check_label(label: LabelProfile, task: str, drop_null_labels: bool, positive: object = None) -> None:
    """One DataError when the label cannot be learned as `task` (binary with `positive`, its
    two values named)."""
    where, name = label.where, label.name
    if label.rows and label.nulls == label.rows:
        raise DataError(f"{where}: label column '{name}' is null in every row ({label.rows}); choose another "
                        "data.label")
    if label.nulls and not drop_null_labels:
        raise DataError(f"{where}: label column '{name}' is null in {label.nulls} of {label.rows} rows, the first at "
                        f"row {label.first_null}; fill them, or leave those rows out with --set data.drop_null_labels=true")
    other = infer_task(label)[0]
    hint = f" (its values suggest --set data.task={other})" if other != task else ""
    if task == "binary" and positive is not None:
        if label.many or len(label.distinct) > 2:
            extra = [v for v in label.distinct if v != positive][1:2]
            raise DataError(f"{where}: label column '{name}' holds more than two values for data.task binary "
                            f"(positive {positive!r}; another: {extra[0] if extra else 'many'!r}); fix the rows, or "
                            "set data.task: multiclass")
    elif task == "binary":
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
