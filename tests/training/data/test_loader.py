from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from training.data.ingest.packing import pack_local
from training.config import RetrainConfig
from training.data.prepare.features import fit_feature_stats
from training.data.load.loader import ShardBatches, StreamPosition, make_train_loader
from training.data.manifest import shard_folder

from training.errors import DataError


@pytest.fixture
def packed(small_config: RetrainConfig, demo_source: Path, tmp_path: Path):
    d, manifest, _ = pack_local(demo_source, small_config.data, tmp_path / "datasets")
    _, stats = fit_feature_stats(d, manifest, small_config.preprocess, tmp_path / "pre")
    return d, manifest, stats


def _take(loader, n: int) -> list[tuple]:
    out = []
    it = iter(loader)
    for item in it:
        out.append(item)
        if len(out) == n:
            getattr(it, "_shutdown_workers", lambda: None)()
            return out
    raise AssertionError("stream ended")


def test_seek_equals_sequential_reading(packed) -> None:
    d, manifest, stats = packed
    batches = ShardBatches(d, manifest, "train", 100, stats.transformer(), seed=3)
    per_epoch = batches.batches_per_epoch
    sequential = _take(make_train_loader(batches, StreamPosition(), 0, False), per_epoch + 10)
    start = per_epoch - 5  # crosses the epoch boundary
    resumed = _take(make_train_loader(batches, StreamPosition(0, start), 0, False), 15)
    for a, b in zip(sequential[start:], resumed, strict=True):
        assert a[:2] == b[:2]
        assert a[2].keys() == b[2].keys() == {"num", "cat", "label"}
        for k in a[2]:
            assert torch.equal(a[2][k], b[2][k])


def test_an_epochs_batches_do_not_depend_on_what_was_kept(packed) -> None:
    """Epoch 1 is the same whether its shards were kept from epoch 0, are loaded for it, or are
    never kept; and it is what the module docstring defines: shards permuted by (seed, epoch),
    rows by (seed, epoch, shard), then consecutive slices."""
    d, manifest, stats = packed

    def epoch(batches: ShardBatches, e: int) -> dict[str, np.ndarray]:
        got = [batches.batch(e, i) for i in range(batches.batches_per_epoch)]
        return {k: np.concatenate([b[k].numpy() for b in got]) for k in ("num", "cat", "label")}

    after_epoch0 = ShardBatches(d, manifest, "train", 100, stats.transformer(), seed=3)
    epoch(after_epoch0, 0)
    assert len(after_epoch0._base) == len(after_epoch0.shards)  # all kept
    variants = [epoch(after_epoch0, 1), epoch(ShardBatches(d, manifest, "train", 100, stats.transformer(), seed=3), 1),
                epoch(ShardBatches(d, manifest, "train", 100, stats.transformer(), seed=3, cache_bytes=0), 1)]
    in_file_order = ShardBatches(d, manifest, "train", 100, stats.transformer(), shuffle=False)
    shards = np.random.default_rng([3, 1, 0]).permutation(len(in_file_order.shards))
    parts = [(in_file_order._shard_arrays(int(i)), np.random.default_rng([3, 1, 1, int(i)]).permutation(
        in_file_order.shards[int(i)].rows)) for i in shards]
    n = after_epoch0.batches_per_epoch * 100
    expected = {k: np.concatenate([arrays[k][rows] for arrays, rows in parts])[:n] for k in ("num", "cat", "label")}
    for got in variants:
        assert all(np.array_equal(got[k], expected[k]) for k in expected)


def test_each_shard_is_loaded_once_when_the_next_epoch_starts_with_the_last_one(packed, monkeypatch) -> None:
    """Prefetching reads ahead across the epoch boundary: a shard that ends one epoch and starts
    the next is read, checked and transformed once, then only put in the new epoch's order."""
    d, manifest, stats = packed
    seed = next(s for s in range(200) if (lambda b: b._shard_order(0)[-1] == b._shard_order(1)[0])(
        ShardBatches(d, manifest, "train", 64, stats.transformer(), seed=s)))
    loads: list[int] = []
    load = ShardBatches._load_shard
    monkeypatch.setattr(ShardBatches, "_load_shard", lambda self, i, *a: loads.append(i) or load(self, i, *a))
    batches = ShardBatches(d, manifest, "train", 64, stats.transformer(), seed=seed)
    _, starts = batches._order(0)
    resume_at = -(-int(starts[-3]) // 64)  # a resume in the shard before the last: the window then spans both epochs
    for e, first in ((0, resume_at), (1, 0)):
        for i in range(first, batches.batches_per_epoch):
            batches.batch(e, i)
    assert sorted(loads) == list(range(len(batches.shards)))


def test_transform_into_held_buffers_gives_the_same_rows(packed) -> None:
    """The loader's prefetch threads transform each shard into buffers they keep (new memory is
    paid once, not per shard): the rows are the same as a fresh transform's."""
    from training.data.shards import ShardReader

    d, manifest, stats = packed
    transform, buffers = stats.transformer(), {}
    for info in manifest.shards_of("train")[:2]:
        reader = ShardReader(shard_folder(d, info) / info.name)
        blocks = [reader.block(key) for key in reader.keys]
        fresh, held = transform.shard(blocks, info.name), transform.shard(blocks, info.name, buffers)
        assert fresh.keys() == held.keys() and all(np.array_equal(fresh[k], held[k]) for k in fresh)
        assert all(np.shares_memory(held[k], buffers[k]) for k in held)
        del blocks
        reader.close()


def test_workers_deliver_the_single_process_order(packed) -> None:
    d, manifest, stats = packed
    batches = ShardBatches(d, manifest, "train", 128, stats.transformer(), seed=1)
    single = _take(make_train_loader(batches, StreamPosition(0, 7), 0, False), 20)
    multi = _take(make_train_loader(batches, StreamPosition(0, 7), 2, False), 20)
    assert [tuple(b[:2]) for b in single] == [tuple(b[:2]) for b in multi]
    assert all(torch.equal(a[2][k], b[2][k]) for a, b in zip(single, multi, strict=True) for k in ("num", "cat", "label"))


def test_each_epoch_sees_every_row_once_in_a_new_order(packed) -> None:
    d, manifest, stats = packed
    batches = ShardBatches(d, manifest, "train", 1, stats.transformer(), seed=0)
    rows = manifest.rows["train"]
    epoch0 = np.concatenate([batches.batch(0, i)["num"].numpy() for i in range(rows)])
    epoch1 = np.concatenate([batches.batch(1, i)["num"].numpy() for i in range(rows)])
    assert not np.array_equal(epoch0, epoch1)
    key = lambda a: np.sort(a.view(np.int32).reshape(len(a), -1).sum(axis=1))  # noqa: E731
    assert np.array_equal(key(epoch0), key(epoch1))


def test_corrupt_shard_is_refused(packed) -> None:
    d, manifest, stats = packed
    shard = shard_folder(d, manifest.shards_of("train")[0]) / manifest.shards_of("train")[0].name
    data = bytearray(shard.read_bytes())
    data[2000] ^= 0xFF
    shard.write_bytes(bytes(data))
    batches = ShardBatches(d, manifest, "train", 64, stats.transformer(), shuffle=False)
    with pytest.raises(DataError, match="xxh3_128 does not match"):
        batches.batch(0, 0)


def test_a_manifest_from_before_xxh3_is_checked_with_sha256(packed) -> None:
    """Datasets packed before the loader checked with xxh3_128 have only each shard's sha256:
    they are still checked, with it, and the packer records both hashes of the same bytes."""
    import hashlib
    import json

    import xxhash

    from training.data.manifest import DatasetManifest

    d, manifest, stats = packed
    info = manifest.shards_of("train")[0]
    content = (shard_folder(d, info) / info.name).read_bytes()
    assert info.sha256 == hashlib.sha256(content).hexdigest()
    assert info.xxh3_128 == xxhash.xxh3_128(content).hexdigest()
    raw = json.loads(manifest.to_json())
    for shard in raw["shards"]:
        del shard["xxh3_128"]
    old = DatasetManifest.from_json(json.dumps(raw))
    assert old.shards[0].checksum.algorithm == "sha256"
    ShardBatches(d, old, "train", 64, stats.transformer(), shuffle=False).batch(0, 0)  # intact: it matches
    data = bytearray(content)
    data[2000] ^= 0xFF
    (shard_folder(d, info) / info.name).write_bytes(bytes(data))
    with pytest.raises(DataError, match="sha256 does not match"):
        ShardBatches(d, old, "train", 64, stats.transformer(), shuffle=False).batch(0, 0)


def test_a_corrupt_shard_met_on_the_prefetch_thread_stops_the_stream(packed) -> None:
    """Shards after the first are read, checked and shuffled on background threads: a bad one
    still fails in the training thread, naming the shard, before any of its rows are served."""
    d, manifest, stats = packed
    batches = ShardBatches(d, manifest, "train", 64, stats.transformer(), seed=0)
    order, starts = batches._order(0)
    victim = manifest.shards_of("train")[int(order[1])]
    data = bytearray((shard_folder(d, victim) / victim.name).read_bytes())
    data[-20000] ^= 0xFF
    (shard_folder(d, victim) / victim.name).write_bytes(bytes(data))
    served = 0
    with pytest.raises(DataError, match=f"shard .*{victim.name}: xxh3_128 does not match"):
        for _epoch, _index, batch in make_train_loader(batches, StreamPosition(), 0, False):
            served += len(batch["label"])
    assert served <= int(starts[1])  # nothing past the first shard


def test_batch_larger_than_split_is_a_clear_error(packed) -> None:
    d, manifest, stats = packed
    with pytest.raises(DataError, match="lower train.batch_size"):
        ShardBatches(d, manifest, "validation", 10**6, stats.transformer())


def test_feature_transform(packed) -> None:
    _, _, stats = packed
    t = stats.transformer()
    num = np.array([[np.nan] * len(stats.numeric)], dtype=np.float32)
    cat = np.array([[stats.vocab[j][0] if stats.vocab[j] else 5 for j in range(len(stats.categorical))]], dtype=np.int64)
    cat[0, 0] = 12345  # unseen category
    x, c = t(num, cat)
    assert np.all(x == 0)  # nulls are imputed with the mean
    assert c[0, 0] == 0 and np.all(c[0, 1:] == 1)



def test_a_warm_starts_batches_hold_the_new_rows_in_every_batch_with_the_old_replayed(
        small_config: RetrainConfig, demo_source: Path, tmp_path: Path) -> None:
    """Day 0's rows are all label 0 and day 1's (one segment in eight) all label 1, so a batch's
    label sum counts its new rows. Plain batches slice whole shards in turn; a warm start's
    `MixedBatches` put the new rows' share (times train.new_data_weight) in every batch, from
    the first step on, and resume by the same arithmetic."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from training.data.load.loader import MixedBatches

    table = pq.read_table(demo_source)
    source = tmp_path / "src"
    source.mkdir()
    label = table.column_names.index("clicked")
    day0, day1 = table.slice(0, 7000), table.slice(7000, 1000)
    pq.write_table(day0.set_column(label, "clicked", pa.array(np.zeros(7000, np.int8))), source / "day-0.parquet")
    pq.write_table(day1.set_column(label, "clicked", pa.array(np.ones(1000, np.int8))), source / "day-1.parquet")
    small_config.data.segment_rows = 8000
    d, manifest, _ = pack_local(source, small_config.data, tmp_path / "datasets")
    _, stats = fit_feature_stats(d, manifest, small_config.preprocess, tmp_path / "pre")
    new = {s.key for s in manifest.segments if s.source == "day-1.parquet"}
    share = sum(s.rows for s in manifest.restricted_to(new).shards_of("train")) / manifest.rows["train"]
    for weight in (1.0, 3.0):
        mixed = MixedBatches(d, manifest, new, 128, stats.transformer(), seed=0, cache_bytes=10**8, weight=weight)
        assert mixed.new_rows == round(128 * share * weight)
        epochs = [(e, i) for e in range(2) for i in range(mixed.batches_per_epoch)]
        for e, i in epochs:
            batch = mixed.batch(e, i)
            assert batch["label"].shape[0] == 128 and int(batch["label"].sum()) == mixed.new_rows
        again = MixedBatches(d, manifest, new, 128, stats.transformer(), seed=0, cache_bytes=10**8, weight=weight)
        e, i = epochs[-3]
        assert all(torch.equal(again.batch(e, i)[k], mixed.batch(e, i)[k]) for k in ("num", "cat", "label"))
