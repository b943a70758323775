"""Parquet row groups read once, by byte range, from any source, with the digest of what was read.

A segment of a dataset is a run of row groups of one file. Packing it reads the file's footer
and each row group's byte range, no more: a file's other row groups, and files packed before,
are never touched. Each range is hashed as it arrives, before its rows are decoded, so the
rows' split can depend on the range's content (`training.data.ingest.splits`) and the segment's
content address covers every byte the decoder used.

pyarrow decodes through `RangeFile`, a read-only file object that serves the footer and the
loaded range from memory. A read that falls outside both (a writer that placed pages where its
own metadata does not say) is served from the source and folded into the digest too, so the
address stays a function of every byte read.
"""

from __future__ import annotations

import hashlib
import io
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from training.data.ingest.sources import Source, SourceFile
from training.errors import DataError

__all__ = ["ParquetRanges", "TAIL_BYTES"]

# The first read from a file's end: its footer, usually a few kB (3.4 kB for a 12-column file of
# one row group); a larger footer costs one more read. pyarrow's own first read is 64 kB.
TAIL_BYTES = 16 << 10
_MAGIC = b"PAR1"


class RangeFile(io.RawIOBase):
    """The file as pyarrow sees it: reads inside the footer or a loaded range come from memory."""

    def __init__(self, source: Source, file: SourceFile, tail: bytes) -> None:
        super().__init__()
        self.source, self.file = source, file
        self.size = file.size
        self._pos = 0
        self._tail_start = file.size - len(tail)
        self._tail = tail
        self._range: tuple[int, bytes] | None = None
        self.outside = hashlib.sha256()  # bytes read outside the footer and the loaded range
        self.outside_reads = 0

    def load(self, start: int, data: bytes) -> None:
        self._range = (start, data)

    def read_range(self, start: int, end: int) -> bytes:
        """Bytes [start, end) of the file, the part inside the footer's first read from memory."""
        if end <= self._tail_start:
            return self.source.read(self.file.name, start, end - start)
        head = self.source.read(self.file.name, start, self._tail_start - start) if start < self._tail_start else b""
        return head + self._tail[max(start, self._tail_start) - self._tail_start : end - self._tail_start]

    def unload(self) -> None:
        self._range = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset if whence == 0 else self._pos + offset if whence == 1 else self.size + offset
        return self._pos

    def read(self, n: int = -1) -> bytes:
        start = self._pos
        end = self.size if n is None or n < 0 else min(self.size, start + n)
        data = self._from_memory(start, end)
        if data is None:
            data = self.source.read(self.file.name, start, end - start)
            self.outside.update(f"{start}:{end - start};".encode())
            self.outside.update(data)
            self.outside_reads += 1
        self._pos = end
        return data

    def readinto(self, b: Any) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)

    def _from_memory(self, start: int, end: int) -> bytes | None:
        if start >= self._tail_start:
            return self._tail[start - self._tail_start : end - self._tail_start]
        if self._range is not None:
            lo, data = self._range
            if lo <= start and end <= lo + len(data):
                return data[start - lo : end - lo]
        return None


class ParquetRanges:
    """One source file opened for reading row groups by range: its footer read once."""

    def __init__(self, source: Source, file: SourceFile) -> None:
        self.where = source.where(file.name)
        file = source.as_parquet(file)  # a CSV file: its conversion (training.data.ingest.csv_files)
        self.source, self.file = source, file
        if file.size < 12:
            raise DataError(f"{self.where}: not a Parquet file ({file.size} bytes)")
        tail = source.read(file.name, file.size - min(file.size, TAIL_BYTES), min(file.size, TAIL_BYTES))
        footer = int.from_bytes(tail[-8:-4], "little") + 8
        if tail[-4:] != _MAGIC or footer > file.size:
            raise DataError(f"{self.where}: not a readable Parquet file (truncated or corrupt?): no Parquet footer")
        if footer > len(tail):  # a footer larger than the first read: one more
            tail = source.read(file.name, file.size - footer, footer)
        self.footer = tail[-footer:]
        self._file = RangeFile(source, file, tail)
        try:
            # Parsed from the bytes read above and handed to pyarrow, which would otherwise read
            # the file's last 64 kB itself.
            metadata = pq.read_metadata(pa.BufferReader(_MAGIC + self.footer))
            self.parquet = pq.ParquetFile(self._file, metadata=metadata)
            self.metadata = self.parquet.metadata
            self.schema = self.parquet.schema_arrow
        except (pa.ArrowInvalid, OSError) as err:
            raise DataError(f"{self.where}: not a readable Parquet file (truncated or corrupt?): {err}") from None

    @property
    def schema_text(self) -> str:
        """The Parquet schema (physical and logical types) and the Arrow schema it decodes to."""
        parquet = str(self.metadata.schema).split("\n", 1)[-1]  # the first line is the object's address
        return f"{parquet}\n{self.schema}"

    @property
    def row_group_rows(self) -> list[int]:
        return [self.metadata.row_group(i).num_rows for i in range(self.metadata.num_row_groups)]

    def byte_range(self, group: int) -> tuple[int, int]:
        """[start, end) of row group `group`'s column chunks, as its metadata places them."""
        rg = self.metadata.row_group(group)
        starts, ends = [], []
        for j in range(rg.num_columns):
            col = rg.column(j)
            first = col.data_page_offset
            if col.has_dictionary_page and col.dictionary_page_offset and col.dictionary_page_offset > 0:
                first = min(first, col.dictionary_page_offset)
            starts.append(first)
            ends.append(first + col.total_compressed_size)
        if not starts:
            return 0, 0
        return max(0, min(starts)), min(self.file.size, max(ends))

    def group_metadata(self, group: int) -> dict[str, Any]:
        """Row group `group`'s metadata as a plain dict: codecs, encodings, types and places, which
        decide how its bytes decode (part of a segment's content address)."""
        return _plain(self.metadata.row_group(group).to_dict())

    def load_group(self, group: int) -> str:
        """Read row group `group`'s byte range into memory for decoding; its sha256."""
        start, end = self.byte_range(group)
        data = self._file.read_range(start, end)
        self._file.load(start, data)
        return hashlib.sha256(data).hexdigest()

    def batches(self, group: int, columns: list[str], batch_rows: int) -> Any:
        """The loaded row group's rows, `batch_rows` at a time (`load_group` first)."""
        try:
            yield from self.parquet.iter_batches(batch_size=batch_rows, row_groups=[group], columns=columns)
        except (pa.ArrowInvalid, OSError) as err:
            raise DataError(f"{self.where}: not a readable Parquet file (truncated or corrupt?): {err}") from None
        finally:
            self._file.unload()

    @property
    def outside_digest(self) -> str:
        """The digest of bytes read outside the footer and the loaded ranges ("" when none were)."""
        return self._file.outside.hexdigest() if self._file.outside_reads else ""


def _plain(value: Any) -> Any:
    """JSON-ready: a binary column's statistics are bytes."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)
