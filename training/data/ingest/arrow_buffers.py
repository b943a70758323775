"""Arrow arrays read and made through their buffers.

pyarrow's `Array.to_numpy()`, `pa.array()` and `pa.scalar()` import pandas on first use, to
check for pandas objects these arrays never are: 0.2 s, in every training process's first epoch
and in every `retrain predict` (a tenth of its fixed cost). These helpers touch the buffers
instead; each returns what the pyarrow call would have.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["arrow_float32", "arrow_float64", "arrow_int8", "arrow_int64", "float32_values", "int32_values",
           "int64_values", "null_mask", "one_chunk", "validity"]


def one_chunk(array: pa.Array | pa.ChunkedArray) -> pa.Array:
    return array.combine_chunks() if isinstance(array, pa.ChunkedArray) else array


def _arrow(values: np.ndarray, arrow_type: pa.DataType, dtype: type[np.generic]) -> pa.Array:
    values = np.ascontiguousarray(values, dtype=dtype)
    return pa.Array.from_buffers(arrow_type, len(values), [None, pa.py_buffer(values)])


def arrow_int64(values: np.ndarray) -> pa.Array:
    return _arrow(values, pa.int64(), np.int64)


def arrow_float32(values: np.ndarray) -> pa.Array:
    return _arrow(values, pa.float32(), np.float32)


def arrow_float64(values: np.ndarray) -> pa.Array:
    return _arrow(values, pa.float64(), np.float64)


def arrow_int8(values: np.ndarray) -> pa.Array:
    return _arrow(values, pa.int8(), np.int8)


def int32_values(array: pa.Array) -> np.ndarray:
    """The value slots of an int32 array (those under nulls are undefined)."""
    return np.frombuffer(array.buffers()[1], dtype=np.int32, count=len(array) + array.offset)[array.offset:]


def int64_values(array: pa.Array) -> np.ndarray:
    """The value slots of an int64 array (those under nulls are undefined)."""
    return np.frombuffer(array.buffers()[1], dtype=np.int64, count=len(array) + array.offset)[array.offset:]


def validity(array: pa.Array) -> np.ndarray:
    """1 where `array` holds a value, 0 where it holds null."""
    if array.buffers()[0] is None:
        return np.ones(len(array), dtype=np.uint8)
    bits = np.frombuffer(array.buffers()[0], dtype=np.uint8)
    return np.unpackbits(bits, count=len(array) + array.offset, bitorder="little")[array.offset:]


def null_mask(array: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """True where `array` holds null."""
    return validity(one_chunk(array)) == 0


def float32_values(array: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A numeric array as float32, a null as NaN (read-only when no copy was needed)."""
    floats = one_chunk(pc.cast(array, pa.float32()))
    if floats.null_count:
        floats = one_chunk(pc.fill_null(floats, pa.scalar(np.nan, pa.float32())))
    return np.frombuffer(floats.buffers()[1], dtype=np.float32, count=len(floats) + floats.offset)[floats.offset:]
