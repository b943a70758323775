from __future__ import annotations

import hashlib
import tarfile
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds

from tests.conftest import small_overrides
from training.data.ingest.packing import pack_local
from training.config import RetrainConfig, load_config
from training.data.manifest import load_manifest
from training.data.shards import ShardReader
from training.errors import DataError
from training.pipeline.pack_stage import pack_stage


def _pack(config: RetrainConfig, source: Path, root: Path):
    return pack_local(source, config.data, root / "datasets")


def _tree_hashes(d: Path) -> dict[str, str]:
    """Every file of a dataset: its manifest and the files of its segments."""
    manifest = json.loads((d / "manifest.json").read_text())
    files = [d / "manifest.json", *(p for s in manifest["segments"]
                                    for p in sorted((d.parent / "segments" / s["key"]).iterdir()))]
    return {str(p.relative_to(d.parent)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _shard(d: Path, info: object) -> Path:
    from training.data.manifest import shard_folder

    return shard_folder(d, info) / info.name  # type: ignore[attr-defined]


def test_packing_is_byte_reproducible(small_config: RetrainConfig, demo_source: Path, tmp_path: Path) -> None:
    a, man_a, _ = _pack(small_config, demo_source, tmp_path / "a")
    b, man_b, _ = _pack(small_config, demo_source, tmp_path / "b")
    assert a.name == b.name == man_a.fingerprint
    assert _tree_hashes(a) == _tree_hashes(b)
    assert len(man_a.shards) > 3 and man_a.format_version == 2


def test_shards_hold_micro_batches_with_fixed_metadata(small_config: RetrainConfig, demo_source: Path, tmp_path: Path) -> None:
    d, manifest, _ = _pack(small_config, demo_source, tmp_path)
    shard = _shard(d, manifest.shards[0])
    with tarfile.open(shard) as tar:
        members = tar.getmembers()
    assert all(m.mtime == 0 and m.uid == 0 and m.uname == "" for m in members)
    reader = ShardReader(shard)
    block = reader.block(reader.keys[0])
    assert block.num.shape == (256, len(small_config.data.numeric))
    assert block.cat.shape == (256, len(small_config.data.categorical))
    reader.close()
    assert sum(manifest.rows.values()) == 8000
    for info in manifest.shards:
        p = _shard(d, info)
        assert p.stat().st_size == info.bytes
        assert hashlib.sha256(p.read_bytes()).hexdigest() == info.sha256


def test_shard_sizes_stay_near_the_target(demo_source: Path, tmp_path: Path) -> None:
    config = load_config(overrides=["data.rows_per_member=64", "data.shard_size_mb=0.2"])
    _, manifest, _ = pack_local(demo_source, config.data, tmp_path)
    full = [s for s in manifest.shards_of("train")][:-1]
    assert full and all(0.95 * 200_000 <= s.bytes <= 200_000 for s in full)


def test_webdataset_reads_the_shards(small_config: RetrainConfig, demo_source: Path, tmp_path: Path) -> None:
    d, manifest, _ = _pack(small_config, demo_source, tmp_path)
    urls = [str(_shard(d, s)) for s in manifest.shards_of("test")]
    rows = 0
    for sample in wds.WebDataset(urls, shardshuffle=False).decode():
        assert sample["num.npy"].dtype == np.float32
        rows += len(sample["label.npy"])
    assert rows == manifest.rows["test"]


def test_rerun_writes_nothing(small_config: RetrainConfig, demo_source: Path, tmp_path: Path) -> None:
    d, _, reused = _pack(small_config, demo_source, tmp_path)
    assert not reused
    datasets = tmp_path / "datasets"
    before = {p: p.stat().st_mtime_ns for p in datasets.rglob("*")}
    d2, _, reused2 = _pack(small_config, demo_source, tmp_path)
    assert reused2 and d2 == d
    assert {p: p.stat().st_mtime_ns for p in datasets.rglob("*")} == before
    assert sorted(p.name for p in datasets.iterdir() if not p.name.startswith(".")) == sorted(
        [d.name, "segments", "source-index.json"])


def test_split_is_deterministic_and_near_the_fractions(small_config: RetrainConfig, demo_source: Path, tmp_path: Path) -> None:
    _, manifest, _ = _pack(small_config, demo_source, tmp_path)
    assert abs(manifest.rows["test"] / 8000 - 0.1) < 0.02
    assert abs(manifest.rows["validation"] / 8000 - 0.1) < 0.02


def test_directory_source(small_config: RetrainConfig, demo_source: Path, tmp_path: Path) -> None:
    table = pq.read_table(demo_source)
    src = tmp_path / "src"
    src.mkdir()
    pq.write_table(table.slice(0, 5000), src / "part-0.parquet")
    pq.write_table(table.slice(5000), src / "part-1.parquet")
    _, manifest, _ = pack_local(src, small_config.data, tmp_path / "datasets")
    assert sum(manifest.rows.values()) == 8000


# ---- bad input: one clear line naming the problem, and earlier datasets untouched ----

def _write(path: Path, table: pa.Table) -> Path:
    pq.write_table(table, path)
    return path


@pytest.fixture
def packed_before(small_config: RetrainConfig, demo_source: Path, tmp_path: Path) -> tuple[Path, dict[str, str]]:
    d, _, _ = _pack(small_config, demo_source, tmp_path)
    return d, _tree_hashes(d)


def _bad_cases(demo_source: Path, tmp_path: Path) -> dict[str, tuple[Path, str]]:
    table = pq.read_table(demo_source)
    truncated = tmp_path / "truncated.parquet"
    truncated.write_bytes(demo_source.read_bytes()[:5000])
    prices = table.column("price").to_pylist()
    prices_text = [str(p) for p in prices]
    prices_text[123] = "abc"
    labels = table.column("clicked").to_numpy().astype(np.float64)
    labels_nan = labels.copy()
    labels_nan[50] = np.nan
    labels_two = labels.copy()
    labels_two[60] = 2
    i = table.schema.get_field_index
    return {
        "missing file": (tmp_path / "absent.parquet", "does not exist"),
        "truncated": (truncated, "not a readable Parquet file"),
        "missing label": (_write(tmp_path / "nolabel.parquet", table.drop_columns(["clicked"])), r"missing column\(s\) \['clicked'\]"),
        "missing feature": (_write(tmp_path / "nofeat.parquet", table.drop_columns(["brand"])), r"missing column\(s\) \['brand'\]"),
        "non-numeric": (_write(tmp_path / "text.parquet", table.set_column(i("price"), "price", pa.array(prices_text))),
                        r"column 'price' has non-numeric value 'abc' at row 123"),
        "nan label": (_write(tmp_path / "nan.parquet", table.set_column(i("clicked"), "clicked", pa.array(labels_nan))),
                      r"label column 'clicked' must be 0 or 1, found nan at row 50"),
        "label 2": (_write(tmp_path / "two.parquet", table.set_column(i("clicked"), "clicked", pa.array(labels_two))),
                    r"must be 0 or 1, found 2\.0 at row 60"),
        "empty": (_write(tmp_path / "empty.parquet", table.slice(0, 0)), r"the table is empty"),
        "single class": (_write(tmp_path / "one.parquet", table.set_column(
            i("clicked"), "clicked", pa.array(np.ones(len(table), dtype=np.int8)))), r"has only class 1"),
    }


@pytest.mark.parametrize("case", ["missing file", "truncated", "missing label", "missing feature", "non-numeric",
                                  "nan label", "label 2", "empty", "single class"])
def test_bad_input_is_named_and_nothing_is_lost(
    case: str, small_config: RetrainConfig, demo_source: Path, tmp_path: Path, packed_before: tuple[Path, dict[str, str]]
) -> None:
    source, pattern = _bad_cases(demo_source, tmp_path)[case]
    with pytest.raises(DataError, match=pattern) as info:
        pack_local(source, small_config.data, tmp_path / "datasets")
    assert "\n" not in str(info.value)
    if case not in ("missing file", "empty", "single class"):
        assert source.name in str(info.value)
    d, hashes = packed_before
    assert _tree_hashes(d) == hashes
    datasets = tmp_path / "datasets"
    assert sorted(p.name for p in datasets.iterdir() if not p.name.startswith(".")) == sorted(
        [d.name, "segments", "source-index.json"])
    assert not list(datasets.glob("segments/.partial-*"))  # no partial leftovers


def test_a_damaged_dataset_is_never_used_silently(small_config: RetrainConfig, demo_source: Path, tmp_path: Path) -> None:
    d, manifest, _ = _pack(small_config, demo_source, tmp_path)
    shard = _shard(d, manifest.shards[0])
    shard.write_bytes(shard.read_bytes()[:-512])
    with pytest.raises(DataError, match="wrong size; run the same command again"):
        load_manifest(d)


def _multi_file_source(tmp_path: Path, demo_source: Path) -> Path:
    """The demo rows over three files with several row groups each."""
    table = pq.read_table(demo_source)
    out = tmp_path / "multi"
    out.mkdir()
    third = table.num_rows // 3
    for i, lo in enumerate((0, third, 2 * third)):
        hi = table.num_rows if i == 2 else lo + third
        pq.write_table(table.slice(lo, hi - lo), out / f"part-{i}.parquet", row_group_size=700)
    return out


SEGMENTED = ["data.segment_rows=1400"]  # two row groups a segment: several segments a file


def test_parallel_packing_is_byte_identical_to_serial(tmp_path: Path, demo_source: Path) -> None:
    import random
    from concurrent.futures import ThreadPoolExecutor

    from training.pipeline.pack_stage import pack_begin, pack_finish, pack_segment_stage

    source = _multi_file_source(tmp_path, demo_source)
    serial = pack_stage(load_config(overrides=small_overrides(tmp_path / "serial", source) + SEGMENTED))

    config = load_config(overrides=small_overrides(tmp_path / "parallel", source) + SEGMENTED)
    begun = pack_begin(config)
    todo = begun.plan.todo
    assert len(todo) >= 6 and len({p.file.name for p in todo}) == 3
    order = list(range(len(todo)))
    random.Random(3).shuffle(order)  # finish order must not matter
    with ThreadPoolExecutor(4) as pool:
        done = dict(zip(order, pool.map(lambda i: pack_segment_stage(config, todo[i]), order), strict=True))
    parallel = pack_finish(config, begun, [done[i] for i in order])

    assert parallel.fingerprint == serial.fingerprint and parallel.segments == len(todo)
    a, b = Path(serial.dataset_dir), Path(parallel.dataset_dir)
    assert _tree_hashes(a) == _tree_hashes(b)
    assert not list((tmp_path / "parallel").rglob(".partial-*"))  # work folders renamed into place


def test_a_bad_row_in_one_segment_names_file_column_and_row(tmp_path: Path, demo_source: Path) -> None:
    source = _multi_file_source(tmp_path, demo_source)
    table = pq.read_table(source / "part-2.parquet")
    prices = table.column("price").to_pylist()
    prices[1500] = float("inf")
    table = table.set_column(table.schema.get_field_index("price"), "price", pa.array(prices, pa.float64()))
    pq.write_table(table, source / "part-2.parquet", row_group_size=700)
    config = load_config(overrides=small_overrides(tmp_path / "root", source) + SEGMENTED)
    with pytest.raises(DataError, match=r"part-2\.parquet: column 'price' has an infinite value at row 1500"):
        pack_stage(config)
    datasets = tmp_path / "root" / "datasets"
    assert not list(datasets.glob("*/manifest.json"))  # no dataset of bad data
    assert not list(datasets.glob("segments/.partial-*"))  # nothing half-written left behind
    # The good segments are kept: once the row is fixed, only what held it is packed again.
    prices[1500] = 1.0
    pq.write_table(table.set_column(table.schema.get_field_index("price"), "price", pa.array(prices, pa.float64())),
                   source / "part-2.parquet", row_group_size=700)
    fixed = pack_stage(config)
    assert fixed.segments_packed < fixed.segments


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full to fail a write")
def test_a_failed_shard_write_is_named_and_leaves_no_segment(small_config: RetrainConfig, demo_source: Path,
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Shard bytes go to disk on a background thread: its write error still stops the pack,
    names the shard, and leaves neither a segment nor a work folder behind."""
    import training.data.ingest.segments as segments
    from training.errors import StorageError

    real = segments.SplitWriter

    def to_dev_full(split: str, out_dir: Path, config: object) -> object:
        if split == "train":
            (out_dir / "train-000000.tar").symlink_to("/dev/full")  # every write: ENOSPC
        return real(split, out_dir, config)  # type: ignore[arg-type]

    monkeypatch.setattr(segments, "SplitWriter", to_dev_full)
    with pytest.raises(StorageError, match=r"cannot write shard .*train-000000\.tar: No space left on device"):
        pack_local(demo_source, small_config.data, tmp_path / "datasets")
    assert [p.name for p in (tmp_path / "datasets" / "segments").iterdir()] == []


@pytest.mark.parametrize("damage", ["flipped-byte", "missing-shard", "garbage-manifest"])
def test_a_damaged_reused_segment_is_packed_again_with_a_warning(
    small_config: RetrainConfig, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    from training.pipeline.pack_stage import pack_stage

    first = pack_stage(small_config)
    dataset = Path(first.dataset_dir)
    manifest = json.loads((dataset / "manifest.json").read_text())
    folder = dataset.parent / "segments" / manifest["segments"][0]["key"]
    segment = (folder / "segment.json").read_bytes()
    shard = folder / manifest["shards"][0]["name"]
    assert pack_stage(small_config).reused  # sound: reused, and verified once
    if damage == "flipped-byte":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))  # same size: only the hash can tell
    elif damage == "missing-shard":
        shard.unlink()
    else:
        (folder / "segment.json").write_text('{"shards": 3}')
    with caplog.at_level("WARNING"):
        again = pack_stage(small_config)
    assert not again.reused and again.fingerprint == first.fingerprint
    assert "packing" in caplog.text and "again" in caplog.text
    if damage == "flipped-byte":
        assert f"shard {shard.name} does not match its xxh3_128" in caplog.text  # the fast check found it
    assert (folder / "segment.json").read_bytes() == segment  # the same bytes as before
    assert json.loads((dataset / "manifest.json").read_text()) == manifest
    assert not [p for p in folder.parent.iterdir() if ".removed-" in p.name or ".partial-" in p.name]


def test_a_shard_whose_buffered_bytes_cannot_go_either_is_still_named(tmp_path: Path) -> None:
    """A full disk fails a write while earlier bytes still sit in the file's buffer: closing the
    file then fails too, and that must not replace the error naming the shard (a traceback on a
    full disk, seen while packing parts)."""
    from training.data.shards import ShardTarWriter
    from training.errors import StorageError

    shard = tmp_path / "train-000000.tar"
    shard.symlink_to("/dev/full")  # every write: ENOSPC
    writer = ShardTarWriter(shard)
    writer.add("0.num.npy", b"x" * 100)  # buffered: not written yet
    with pytest.raises(StorageError, match=r"cannot write shard .*train-000000\.tar: No space left on device"):
        writer.add("1.num.npy", b"y" * 100)
        writer.close().result()
