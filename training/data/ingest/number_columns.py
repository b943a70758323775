"""Columns of numbers that a few values turned into text.

A CSV reader types a column from its values: one `oops` among 120,000 numbers makes the whole
column text, and it would then train as a category with 120,000 levels. Before anything starts,
such a column is reported with what was seen: the column, the first value that is not a number,
and its row. Parquet columns are typed by their writer, so the same check finds a writer that
stored numbers as strings.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from training.data.ingest.parquet_reader import ParquetRanges
from training.errors import DataError

__all__ = ["NotANumber", "check_number_columns", "first_not_a_number", "looks_numeric"]

NUMBER = r"^\s*[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?\s*$"
STRAYS = 0.01  # a text column whose values are all numbers but at most this share is numbers gone astray
MIN_ROWS_FOR_ONE_STRAY = 20


def looks_numeric(values: pa.Array) -> bool:
    """Whether a string array's non-null values read as numbers but for at most one in a
    hundred (at least one number): a stray among a sample's first rows must not hide a
    numeric column, which then trained silently as a category, where the same stray further
    down was reported (`check_number_columns` reads the whole column)."""
    present = values.drop_null()
    if len(present) == 0:
        return False
    numbers = int(pc.sum(pc.match_substring_regex(present, NUMBER)).as_py() or 0)
    one = 1 if len(present) >= MIN_ROWS_FOR_ONE_STRAY else 0  # in a handful of values one word is no stray
    return numbers > 0 and len(present) - numbers <= max(one, STRAYS * len(present))


class NotANumber:
    """The values of a text column that are not numbers: how many, of how many, the first and its row."""

    def __init__(self, count: int, of: int, first: str, row: int) -> None:
        self.count, self.of, self.first, self.row = count, of, first, row


def first_not_a_number(ranges: ParquetRanges, name: str) -> NotANumber | None:
    """Reads column `name` of the file (that column alone); None when every value is a number."""
    count = of = seen = 0
    first: tuple[str, int] | None = None
    for batch in ranges.parquet.iter_batches(batch_size=65_536, columns=[name]):
        column = batch.column(0)
        numeric = pc.match_substring_regex(column, NUMBER)
        bad = pc.and_(pc.is_valid(column), pc.invert(pc.fill_null(numeric, True)))
        count += int(pc.sum(bad).as_py() or 0)
        of += len(column) - column.null_count
        if first is None and count:
            at = int(pc.index(bad, True).as_py())
            first = (str(column[at].as_py()), seen + at + 1)
        seen += len(column)
    return None if first is None else NotANumber(count, of, first[0], first[1])


def check_number_columns(ranges: ParquetRanges, declared: list[str], candidates: list[str]) -> None:
    """`declared`: text columns the config names numeric: each is one DataError naming its first
    value that is not a number. `candidates`: text columns whose first rows are all numbers: one
    whose strays are few (STRAYS) is one DataError too, rather than a silent category."""
    for name in declared:
        found = first_not_a_number(ranges, name)
        if found is not None:
            raise DataError(f"{ranges.where}: column '{name}' (data.numeric) holds text: row {found.row} is "
                            f"{found.first!r}, and {found.count - 1} more value(s) are not numbers; fix those "
                            "values in the file, or list the column in data.categorical")
    for name in candidates:
        found = first_not_a_number(ranges, name)
        if found is not None and found.count <= max(1, STRAYS * found.of):
            raise DataError(
                f"{ranges.where}: column '{name}' reads as text because {found.count} of its {found.of} values "
                f"are not numbers, the first {found.first!r} at row {found.row}; fix those values in the file, or "
                f"say what the column is: --set data.numeric=[...] or --set data.categorical=[..., {name}]")
