"""CSV files in a source, read through pyarrow's CSV reader and packed as Parquet would be.

A CSV file has no row groups and no footer, which segments and ranged reads rest on. So the
first time a process reads one, it converts the whole file to Parquet in a private temporary
folder (streamed: one block of CSV and one row group in memory at a time), and every read of
that file is then served from the conversion. The conversion is a function of the CSV's
bytes (fixed block size, row group size and writer options), so every process that packs a
part of the file, on any machine, sees the same row groups and the same bytes: the segments
and their content addresses are the same as a serial pack's.

Nothing is kept in the storage root: the root is input from whoever can write it, and a
converted copy there would be one more file to trust. The source index still remembers each
CSV file by its identity stamp, so an unchanged file is never read, or converted, again.
Parquet stays the better format for large data: a CSV is read whole by each process that packs
a part of it.
"""

from __future__ import annotations

import atexit
import gzip
import hashlib
import io
import shutil
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from training.errors import DataError

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["CONVERSIONS", "CSV_SUFFIXES", "CsvConversions", "is_csv"]

CSV_SUFFIXES = (".csv", ".csv.gz", ".tsv", ".tsv.gz")
ROW_GROUP_ROWS = 65_536  # as a Parquet writer's usual row groups: a segment is a run of them
_BLOCK_BYTES = 8 << 20  # types are inferred from the first block: a larger one sees more rows


def is_csv(name: str) -> bool:
    return name.lower().endswith(CSV_SUFFIXES)


class CsvConversions:
    """The Parquet conversions of CSV files, made on first use in this process and shared by
    every source object opened on them (the plan, the pack and the flow's source check each
    open the source: the file is converted once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._folder: Path | None = None
        self._done: dict[tuple[str, str, str], Path] = {}  # (source, name, identity stamp) -> converted file
        self._current: dict[tuple[str, str], Path] = {}  # (source, name) -> its latest conversion

    def converted(self, source: str, name: str, stamp: str, where: str, read_all: Callable[[], bytes]) -> Path:
        """The Parquet conversion of CSV file `name` of `source` at identity `stamp`; `read_all`
        reads its bytes."""
        key = (source, name, stamp)
        with self._lock:  # packing reads from several threads: one conversion per file
            path = self._done.get(key)
            if path is None:
                path = self._folder_path() / f"{hashlib.sha256(repr(key).encode()).hexdigest()[:32]}.parquet"
                _convert(read_all(), name, where, path)
                self._done[key] = path
            self._current[(source, name)] = path
            return path

    def path(self, source: str, name: str) -> Path:
        """The conversion of `name` of `source` made last (`converted` first)."""
        with self._lock:
            path = self._current.get((source, name))
        if path is None:
            raise RuntimeError(f"{name} is read before its conversion: call as_parquet first")
        return path

    def _folder_path(self) -> Path:
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="retrain-csv-"))
            atexit.register(shutil.rmtree, self._folder, True)
        return self._folder


def _convert(data: bytes, name: str, where: str, out: Path) -> None:
    """`data` (a CSV file's bytes; gzip-compressed when `name` says so) as a Parquet file at
    `out`, the same bytes every time: one DataError naming the file and column on bad input."""
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    if name.lower().endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as err:
            raise DataError(f"{where}: not a readable gzip file ({err})") from None
    _check_header(data, where)
    delimiter = "\t" if name.lower().removesuffix(".gz").endswith(".tsv") else ","
    read = pcsv.ReadOptions(block_size=_BLOCK_BYTES, use_threads=False)
    parse = pcsv.ParseOptions(delimiter=delimiter)
    tmp = out.with_suffix(".tmp")
    try:
        reader = pcsv.open_csv(io.BytesIO(data), read_options=read, parse_options=parse)
        with pq.ParquetWriter(tmp, reader.schema) as writer:
            pending: list[pa.RecordBatch] = []
            rows = written = 0
            for batch in reader:
                _check_text(batch, where, rows + written * ROW_GROUP_ROWS)
                pending.append(batch)
                rows += batch.num_rows
                while rows >= ROW_GROUP_ROWS:
                    table = pa.Table.from_batches(pending, reader.schema)
                    writer.write_table(table.slice(0, ROW_GROUP_ROWS), row_group_size=ROW_GROUP_ROWS)
                    rest = table.slice(ROW_GROUP_ROWS)
                    pending, rows = rest.to_batches(), rest.num_rows
                    written += 1
            if not rows and not written:
                raise DataError(f"{where}: a header and no rows; add the file's rows, or move it out of the source")
            if rows:
                writer.write_table(pa.Table.from_batches(pending, reader.schema), row_group_size=ROW_GROUP_ROWS)
    except DataError:
        tmp.unlink(missing_ok=True)
        raise
    except pa.ArrowInvalid as err:
        tmp.unlink(missing_ok=True)
        # pyarrow names the column and the value ("In CSV column #2: CSV conversion error to
        # int64: invalid value 'n/a'"); the types come from the first block of rows.
        raise DataError(f"{where}: not a readable CSV file: {str(err).splitlines()[0]} (a column's type is "
                        "taken from its first rows; a later value of another type needs the file as Parquet, "
                        "with the type you mean)") from None
    tmp.replace(out)


def _check_header(data: bytes, where: str) -> None:
    """Column names are UTF-8 text (pyarrow takes other bytes, and Parquet's reader then fails
    on the names with a traceback)."""
    header = data.split(b"\n", 1)[0]
    try:
        header.decode("utf-8")
    except UnicodeDecodeError as err:
        column = header[:err.start].count(b",") + header[:err.start].count(b"\t") + 1
        raise DataError(f"{where}: the header (line 1) is not UTF-8 text: byte 0x{header[err.start]:02x} in the "
                        f"name of column {column}; save the file as UTF-8") from None


def _check_text(batch: pa.RecordBatch, where: str, before: int) -> None:
    """A CSV holds text: a column typed binary holds bytes that are not UTF-8 (never an image)."""
    import pyarrow as pa

    # Only binary columns are read value by value, and a CSV has one only when it is not UTF-8.
    for i, field in enumerate(batch.schema):
        if not (pa.types.is_binary(field.type) or pa.types.is_large_binary(field.type)):
            continue
        for row, value in enumerate(batch.column(i).to_pylist()):
            try:
                if value is not None:
                    value.decode("utf-8")
            except UnicodeDecodeError:
                raise DataError(f"{where}: column '{field.name}' holds bytes that are not UTF-8 text (row "
                                f"{before + row + 1}: {value[:20]!r}); save the file as UTF-8") from None


CONVERSIONS = CsvConversions()  # this process's
