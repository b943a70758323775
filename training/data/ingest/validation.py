"""Parquet columns checked and encoded as the shards store them: the one place a source's values
are validated, for packing and for scoring new rows alike (so a model reads new data exactly as
it read its training data).

A bad value is one DataError naming the file, the column and the row.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from training.config import DataConfig, date_part
from training.data.ingest.arrow_buffers import float32_values, int64_values, null_mask, one_chunk, validity
from training.data.ingest.labels import LABELS, Classes, MulticlassLabels
from training.data.ingest.ragged import Ragged
from training.data.stored_rows import StoredRows
from training.errors import DataError

__all__ = ["MISSING_CATEGORY", "FeatureValidator", "category_hash", "feature_arrays"]

MISSING_CATEGORY = 0  # hash reserved for null categories


def category_hash(values: pa.Array) -> np.ndarray:
    """Stable 63-bit hash per value (str() of it); nulls map to MISSING_CATEGORY.

    Hashing the dictionary of distinct values, not every row, keeps this cheap.
    """
    encoded = pc.dictionary_encode(values.cast(pa.string()) if values.type != pa.string() else values)
    if isinstance(encoded, pa.ChunkedArray):
        encoded = encoded.combine_chunks()
    dictionary = encoded.dictionary.to_pylist()
    table = np.array(
        [
            (int.from_bytes(hashlib.blake2b(v.encode(), digest_size=8).digest(), "little") >> 1) or 1
            for v in dictionary
        ],
        dtype=np.int64,
    )
    indices = one_chunk(pc.cast(encoded.indices, pa.int64()))
    out = np.full(len(values), MISSING_CATEGORY, dtype=np.int64)
    valid = validity(indices).astype(bool)
    if table.size:
        out[valid] = table[int64_values(indices)[valid]]
    return out


class FeatureValidator:
    """Checks each record batch against the configured schema, naming file, column and row."""

    def __init__(self, config: DataConfig) -> None:
        self.config = config

    def check_schema(self, path: str | Path, schema: pa.Schema, with_label: bool = True) -> None:
        c = self.config
        wanted = [*([c.label] if with_label else []), *c.numeric_columns, *c.categorical, *c.vector, *c.text,
                  *c.image]
        if with_label:  # packing reads these too; scoring does not
            wanted += [n for n in (c.split_key, c.time_column) if n is not None and n not in wanted]
        missing = [n for n in wanted if n not in schema.names]
        if missing:
            raise DataError(f"{path}: missing column(s) {missing}; present: {schema.names}")
        repeated = [n for n in wanted if schema.names.count(n) > 1]
        if repeated:
            raise DataError(f"{path}: column '{repeated[0]}' appears {schema.names.count(repeated[0])} times in the "
                            "file's schema; give each column a distinct name")
        if with_label and c.task == "multiclass":
            MulticlassLabels.check_type(path, c.label, schema.field(c.label).type)
        for name in dict.fromkeys(found[0] for n in c.numeric_features if (found := date_part(n)) is not None):
            t = schema.field(name).type
            if not (pa.types.is_timestamp(t) or pa.types.is_date(t)):
                raise DataError(f"{path}: date column '{name}' has type {t}, expected a date or a timestamp")
        for name in c.vector:
            t = schema.field(name).type
            if not ((pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t))
                    and (pa.types.is_floating(t.value_type) or pa.types.is_integer(t.value_type))):
                raise DataError(f"{path}: vector column '{name}' has type {t}, expected a list of floats")
        for name in c.text:
            t = schema.field(name).type
            if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t)):
                raise DataError(f"{path}: text column '{name}' has type {t}, expected strings")
        for name in c.image:
            t = schema.field(name).type
            if not (pa.types.is_binary(t) or pa.types.is_large_binary(t)):
                raise DataError(f"{path}: image column '{name}' has type {t}, expected binary (encoded PNG or JPEG)")

    def time_range(self, path: str | Path, col: pa.Array) -> tuple[float, float] | None:
        """The oldest and newest value of `data.time_column` in seconds since the epoch (None: all
        null). Timestamps of any unit and zone (pandas writes nanoseconds) and dates are read as
        their integers, whose min and max are then scaled: a nanosecond count does not fit a
        float64 exactly, and Arrow's safe cast refuses it."""
        name = self.config.time_column
        t = col.type
        if pa.types.is_timestamp(t):
            ints, scale = pc.cast(col, pa.int64()), {"s": 1, "ms": 1e3, "us": 1e6, "ns": 1e9}[t.unit]
        elif pa.types.is_date(t):
            ints, scale = pc.cast(pc.cast(col, pa.date32()), pa.int32()), 1 / 86400
        elif pa.types.is_integer(t) or pa.types.is_floating(t):
            ints, scale = col, 1
        else:
            raise DataError(f"{path}: data.time_column '{name}' has type {t}, expected a timestamp, a date or "
                            "seconds since the epoch")
        low, high = (v.as_py() for v in pc.min_max(ints).values())
        if low is None:
            return None
        seconds = (float(low) / scale, float(high) / scale)
        if not all(math.isfinite(v) for v in seconds):
            raise DataError(f"{path}: data.time_column '{name}' holds an infinite value; give each row a finite "
                            "time (or null)")
        return seconds

    def date_part(self, path: str | Path, name: str, col: pa.Array, part: str) -> np.ndarray:
        """A part of a date or timestamp column as float32, nulls NaN (imputed like any
        numeric's): local time where the timestamp has a zone, as Arrow extracts it."""
        if pa.types.is_date(col.type):
            col = pc.cast(pc.cast(col, pa.date32()), pa.timestamp("s"))
        elif not pa.types.is_timestamp(col.type):
            raise DataError(f"{path}: date column '{name}' has type {col.type}, expected a date or a timestamp")
        extract = {"year": pc.year, "month": pc.month, "day": pc.day, "dayofweek": pc.day_of_week,
                   "dayofyear": pc.day_of_year, "hour": pc.hour}[part]
        return float32_values(pc.cast(extract(col), pa.float64()))

    def image(self, path: str | Path, name: str, col: pa.Array, first_row: int) -> Ragged:
        """The encoded images as they are (decoded by preprocessing); a null one is an error."""
        if col.null_count:
            i = int(np.flatnonzero(null_mask(col))[0])
            raise DataError(f"{path}: image column '{name}' is null at row {first_row + i}")
        return Ragged.from_arrow(col)

    def vector(self, path: str | Path, name: str, col: pa.Array, first_row: int, dim: int) -> np.ndarray:
        """A (rows, dim) float32 matrix; a null, short, long or non-finite vector is an error."""
        if col.null_count:
            i = int(np.flatnonzero(null_mask(col))[0])
            raise DataError(f"{path}: vector column '{name}' is null at row {first_row + i}")
        lengths = float32_values(pc.list_value_length(col))
        wrong = lengths != dim
        if wrong.any():
            i = int(np.flatnonzero(wrong)[0])
            raise DataError(f"{path}: vector column '{name}' has length {int(lengths[i])} at row {first_row + i}; "
                            f"every row needs {dim} values (the first row's length)")
        values = float32_values(pc.list_flatten(col)).reshape(len(col), dim)
        bad = ~np.isfinite(values).all(axis=1)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise DataError(f"{path}: vector column '{name}' has a NaN or infinite value at row {first_row + i}")
        return values

    def numeric(self, path: str | Path, name: str, col: pa.Array, first_row: int) -> np.ndarray:
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            try:
                col = pc.cast(col, pa.float64())
            except pa.ArrowInvalid:
                bad = next(
                    (i, v) for i, v in enumerate(col.to_pylist()) if v is not None and not _is_float(v)
                )
                raise DataError(
                    f"{path}: column '{name}' has non-numeric value {bad[1]!r} at row {first_row + bad[0]}"
                ) from None
        elif not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type) or pa.types.is_boolean(col.type)
                  or pa.types.is_decimal(col.type)):
            raise DataError(f"{path}: column '{name}' has type {col.type}, expected a numeric type")
        values = float32_values(col)
        # Nulls become NaN and are imputed with the train mean by preprocessing; Inf is an error.
        inf = np.isinf(values)
        if inf.any():
            i = int(np.flatnonzero(inf)[0])
            raise DataError(f"{path}: column '{name}' has an infinite value at row {first_row + i}")
        return values

    def label(self, path: str | Path, col: pa.Array, first_row: int, classes: Classes) -> np.ndarray:
        c = self.config
        two = (c.positive, c.negative) if c.task == "binary" and c.positive is not None else None
        return LABELS[c.task].encode(path, c.label, col, first_row, classes, two)


def _is_float(v: str) -> bool:
    try:
        float(v)
    except ValueError:
        return False
    return True


def feature_arrays(validator: FeatureValidator, path: str | Path, batch: pa.RecordBatch, first: int, vector_dims: list[int],
                   global_first: int = 0) -> StoredRows:
    """The feature columns of a record batch validated and encoded as packing stores them (so
    scoring new data reads them exactly as training did); no label."""
    config, n = validator.config, batch.num_rows
    numeric = config.numeric_features
    num = np.empty((n, len(numeric)), dtype=np.float32)
    for j, name in enumerate(numeric):
        part = date_part(name)
        num[:, j] = (validator.numeric(path, name, batch.column(name), first) if part is None
                     else validator.date_part(path, part[0], batch.column(part[0]), part[1]))
    cat = np.empty((n, len(config.categorical)), dtype=np.int64)
    for j, name in enumerate(config.categorical):
        cat[:, j] = category_hash(batch.column(name))
    vec = None
    if config.vector:
        vec = np.concatenate([validator.vector(path, name, batch.column(name), first, dim)
                              for name, dim in zip(config.vector, vector_dims, strict=True)], axis=1)
    return StoredRows(
        num=num, cat=cat, vec=vec,
        texts=tuple(Ragged.from_arrow(batch.column(name)) for name in config.text),  # a null text is empty
        images=tuple(validator.image(path, name, batch.column(name), first) for name in config.image),
        row=np.arange(global_first, global_first + n, dtype=np.int64) if config.image else None)
