"""Variable-length byte values per row (text, encoded images) that move through packing like
the fixed-width arrays do: taken in a new row order, sliced, concatenated.

Stored in a shard as two arrays under one field: `<field>.npy` (the bytes of every value, one
after another, uint8) and `<field>_offsets.npy` (int64, rows + 1), so `webdataset`'s decoder
reads both as plain arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["OFFSETS", "Ragged", "Rows", "take_rows", "concat_rows"]

OFFSETS = "_offsets"  # suffix of a ragged field's offsets member


@dataclass(frozen=True)
class Ragged:
    """Row i is data[offsets[i]:offsets[i + 1]]; offsets[0] is 0."""

    data: np.ndarray  # uint8
    offsets: np.ndarray  # int64, len(rows) + 1

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + self.offsets.nbytes)

    @classmethod
    def from_arrow(cls, col: pa.Array | pa.ChunkedArray) -> Ragged:
        """A string or binary column's values (a null is empty; the caller checks nulls first)."""
        # Imported here: a shard's reader (and the CLI, through the manifest) never loads pyarrow.
        import pyarrow as pa
        import pyarrow.compute as pc

        if isinstance(col, pa.ChunkedArray):
            col = col.combine_chunks()
        if col.null_count:
            col = pc.fill_null(col, pa.scalar(b"" if pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type)
                                              else "", col.type))
        large = pa.types.is_large_string(col.type) or pa.types.is_large_binary(col.type)
        _, offsets_buf, data_buf = col.buffers()
        offsets = np.frombuffer(offsets_buf, dtype=np.int64 if large else np.int32)[col.offset: col.offset + len(col) + 1]
        start = int(offsets[0]) if len(offsets) else 0
        end = int(offsets[-1]) if len(offsets) else 0
        data = np.frombuffer(data_buf, dtype=np.uint8)[start:end] if data_buf is not None else np.zeros(0, np.uint8)
        return cls(data.copy(), offsets.astype(np.int64) - start)

    def value(self, i: int) -> bytes:
        return self.data[self.offsets[i]: self.offsets[i + 1]].tobytes()

    def texts(self) -> list[str]:
        blob = self.data.tobytes()
        o = self.offsets.tolist()
        return [blob[o[i]: o[i + 1]].decode("utf-8", "replace") for i in range(len(self))]

    def __getitem__(self, rows: slice) -> Ragged:
        start, stop, step = rows.indices(len(self))
        if step != 1:
            raise ValueError("a ragged column is sliced with step 1 only")
        stop = max(start, stop)
        lo, hi = int(self.offsets[start]), int(self.offsets[stop])
        return Ragged(self.data[lo:hi], self.offsets[start: stop + 1] - lo)

    def take(self, order: np.ndarray) -> Ragged:
        starts = self.offsets[:-1][order]
        lengths = (self.offsets[1:] - self.offsets[:-1])[order]
        offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        # Byte j of the result comes from starts[row] + (j - offsets[row]): one vectorised gather.
        index = np.repeat(starts - offsets[:-1], lengths) + np.arange(int(offsets[-1]), dtype=np.int64)
        return Ragged(self.data[index], offsets)

    @staticmethod
    def concat(parts: Sequence[Ragged]) -> Ragged:
        if len(parts) == 1:
            return parts[0]
        shifts = np.cumsum([0] + [len(p.data) for p in parts[:-1]])
        offsets = np.concatenate([parts[0].offsets[:1]] + [p.offsets[1:] + s for p, s in zip(parts, shifts, strict=True)])
        return Ragged(np.concatenate([p.data for p in parts]), offsets.astype(np.int64))


Rows = np.ndarray | Ragged


def take_rows(values: Rows, order: np.ndarray) -> Rows:
    return values.take(order) if isinstance(values, Ragged) else np.take(values, order, axis=0)


def concat_rows(parts: Sequence[Rows]) -> Rows:
    if isinstance(parts[0], Ragged):
        return Ragged.concat(parts)  # type: ignore[arg-type]
    return np.concatenate(parts) if len(parts) > 1 else parts[0]  # type: ignore[arg-type]
