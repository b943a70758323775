"""CSV sources: read through pyarrow's CSV reader, packed into segments as Parquet files are,
with the same checks, and never read again while they are unchanged."""

from __future__ import annotations

import gzip
import hashlib
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

from tests.conftest import small_overrides
from training.config import load_config
from training.data.manifest import require_manifest
from training.data.ingest.sources import LocalSource
from training.errors import DataError
from training.pipeline.pack_stage import pack_stage


def _demo_rows(demo_source: Path) -> pa.Table:
    table = pq.read_table(demo_source)
    return table.drop_columns([c for c in table.column_names if c == "embedding"])  # CSV holds scalars


def test_a_folder_of_csv_files_packs_into_segments_and_reruns_read_nothing(tmp_path: Path, demo_source: Path) -> None:
    table = _demo_rows(demo_source)
    source = tmp_path / "src"
    source.mkdir()
    pcsv.write_csv(table.slice(0, 5000), source / "day-0.csv")
    buf = pa.BufferOutputStream()
    pcsv.write_csv(table.slice(5000, 3000), buf)
    (source / "day-1.csv.gz").write_bytes(gzip.compress(buf.getvalue().to_pybytes()))
    config = load_config(overrides=small_overrides(tmp_path / "root", source))

    first = pack_stage(config)
    assert first.segments == first.segments_packed == 2
    assert sum(first.rows.values()) == 8000 == len(table)
    manifest = require_manifest(Path(first.dataset_dir))
    assert sorted(s.source for s in manifest.segments) == ["day-0.csv", "day-1.csv.gz"]
    again = pack_stage(config)
    assert (again.segments_packed, again.source_bytes_read, again.fingerprint) == (0, 0, first.fingerprint)

    pcsv.write_csv(table.slice(0, 5500), source / "day-0.csv")  # a file rewritten: packed again, the other kept
    grown = pack_stage(config)
    assert grown.segments_packed == 1 and sum(grown.rows.values()) == 8500


def test_a_csv_file_converts_to_the_same_parquet_bytes_in_every_process(tmp_path: Path, demo_source: Path) -> None:
    """Parallel parts of a pack each convert the file in their own process: the row groups, and
    so the segments and their content addresses, must not depend on which process did it. In
    one process the conversion is made once, whichever source object asks."""
    from training.data.ingest import csv_files

    path = tmp_path / "day.csv"
    pcsv.write_csv(_demo_rows(demo_source).slice(0, 3000), path)
    data = path.read_bytes()
    for out in ("a.parquet", "b.parquet"):  # what two processes would each do
        csv_files._convert(data, path.name, str(path), tmp_path / out)
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()

    first, second = LocalSource(path), LocalSource(path)
    converted = first.as_parquet(first.files()[0])
    assert second.as_parquet(second.files()[0]) == converted and second.bytes_read == 0  # not read again
    assert hashlib.sha256(second.read(converted.name, 0, converted.size)).hexdigest() == hashlib.sha256(
        (tmp_path / "a.parquet").read_bytes()).hexdigest()


def test_a_csv_column_of_the_wrong_type_is_one_line_naming_file_and_column(tmp_path: Path, demo_source: Path) -> None:
    table = _demo_rows(demo_source).slice(0, 500)
    # (not "n/a": the CSV reader reads it as a null, as pandas does)
    prices = pa.array(["cheap" if i == 7 else str(v) for i, v in enumerate(table.column("price").to_pylist())])
    source = tmp_path / "day.csv"
    pcsv.write_csv(table.set_column(table.column_names.index("price"), "price", prices), source)
    config = load_config(overrides=small_overrides(tmp_path / "root", source))
    with pytest.raises(DataError) as err:
        pack_stage(config)
    message = str(err.value)
    assert "day.csv" in message and "'price'" in message and "\n" not in message, message


def test_an_unreadable_gzip_csv_is_one_line(tmp_path: Path) -> None:
    source = tmp_path / "day.csv.gz"
    source.write_bytes(b"not gzip at all")
    config = load_config(overrides=small_overrides(tmp_path / "root", source))
    with pytest.raises(DataError, match=r"day\.csv\.gz: not a readable gzip file"):
        pack_stage(config)


def _checked(source: Path, *extra: str):  # type: ignore[no-untyped-def]
    from training.data.ingest.source_check import checked_source

    return checked_source(load_config(overrides=[f"data.source={source}", "data.label=y",
                                                 f"storage.root={source.parent / 'root'}", *extra]))


def test_one_stray_value_among_numbers_is_reported_not_inferred_as_a_category(tmp_path: Path) -> None:
    lines = ["x1,x2,y", *(f"{i * 0.5},{i % 7},{i % 2}" for i in range(5000))]
    lines.insert(4001, "oops,3,1")  # data row 4001
    source = tmp_path / "numbers.csv"
    source.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as err:
        _checked(source)
    message = str(err.value)
    assert "column 'x1' reads as text because 1 of its 5001 values are not numbers, the first 'oops' at row 4001" \
        in message and "\n" not in message
    # Named a category on purpose, it is one.
    config, _ = _checked(source, "data.categorical=[x1]", "data.numeric=[x2]")
    assert config.data.categorical == ["x1"]
    with pytest.raises(DataError, match=r"column 'x1' \(data.numeric\) holds text: row 4001 is 'oops'"):
        _checked(source, "data.numeric=[x1, x2]", "data.categorical=[]")


@pytest.mark.parametrize("row", [6, 4001])
def test_a_stray_word_early_or_late_in_a_numeric_csv_column_is_the_same_one_line(tmp_path: Path, row: int) -> None:
    # Early, the reader types the column text from its first rows; the check must still see
    # the numbers it holds, not a category.
    lines = ["age,x2,y", *(f"{20 + i % 50},{i % 7},{i % 2}" for i in range(5000))]
    lines[row] = "unknown,3,1"  # data row `row`
    source = tmp_path / "people.csv"
    source.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as err:
        _checked(source)
    message = str(err.value)
    assert f"column 'age' reads as text because 1 of its 5000 values are not numbers, the first 'unknown' at row " \
        f"{row}" in message and "\n" not in message, message


def test_a_csv_that_is_not_utf8_or_has_no_rows_is_one_line(tmp_path: Path) -> None:
    header = tmp_path / "header.csv"
    header.write_bytes(b"a,b\xff,y\n1,2,1\n3,4,0\n")
    with pytest.raises(DataError, match=r"header.csv: the header \(line 1\) is not UTF-8 text: byte 0xff in the "
                                        r"name of column 2"):
        _checked(header)
    values = tmp_path / "values.csv"
    values.write_bytes(b"a,b,y\n1,x,1\n2,\xff\xfe,0\n")
    with pytest.raises(DataError, match=r"values.csv: column 'b' holds bytes that are not UTF-8 text \(row 2"):
        _checked(values)
    empty = tmp_path / "empty.csv"
    empty.write_text("a,b,y\n")
    with pytest.raises(DataError, match=r"empty.csv: a header and no rows"):
        _checked(empty)
