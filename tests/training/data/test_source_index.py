"""The source index shared by several writers: what each records survives the others."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from training.config import StorageConfig
from training.data.ingest.dataset_store import CATALOG, DatasetStore, SegmentCatalog
from training.data.manifest import DatasetManifest
from training.data.ingest.segments import SegmentManifest
from training.data.ingest.source_index import IndexedSegment, SourceIndex
from training.data.ingest.sources import SourceFile
from training.storage.root import StorageRoot

WRITERS = 8
SOURCE = "s3://incoming/daily"
SHARED = "f" * 16  # the dataset every writer writes


def _store(storage: dict, writer: int) -> DatasetStore:
    # Each writer has a local folder of its own, as separate machines (or homes) have.
    return DatasetStore(StorageRoot(StorageConfig(**{**storage, "local_dir": f"{storage['local_dir']}-{writer}"})))


def _write(storage: dict, writer: int, start: multiprocessing.synchronize.Barrier) -> None:
    store = _store(storage, writer)
    file = SourceFile(name=f"day-{writer}.parquet", size=1000 + writer, stamp=f"etag-{writer}")
    segment = IndexedSegment(key=f"{writer:064x}", row_groups=[0], file_row=0, rows=10)

    def record(index: SourceIndex) -> None:
        index.record("config", SOURCE, file, [segment])
        time.sleep(0.2)  # every writer holds a copy it read before the others wrote theirs

    start.wait()
    store.update_index(record)
    # Then each writes a dataset of its own, and all of them the same dataset (one fingerprint)
    # with a catalog of their own: written only where absent, so the first one's stands whole.
    mine = SegmentManifest(key=segment.key, format_version=2, source=file.name, row_groups=[0], file_row=0,
                           rows={"train": 0, "validation": 0, "test": 0}, positives={}, shards=[])
    store.write_dataset(_dataset(f"{writer:016x}"), [mine])
    store.write_dataset(_dataset(SHARED), [mine])


def _dataset(fingerprint: str) -> DatasetManifest:
    return DatasetManifest(fingerprint=fingerprint, format_version=2, label="y", numeric=[], categorical=[],
                           rows={"train": 0, "validation": 0, "test": 0}, positives={})


@pytest.mark.parametrize("where", ["local", "s3"])
def test_eight_writers_racing_on_the_source_index_and_the_manifests_lose_nothing(where: str, tmp_path: Path,
                                                               request: pytest.FixtureRequest) -> None:
    if where == "s3":
        server, bucket = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket")
        storage = {"root": f"s3://{bucket}/root", "endpoint_url": server, "local_dir": str(tmp_path / "home")}
    else:
        storage = {"root": str(tmp_path / "shared-root"), "local_dir": str(tmp_path / "home")}
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(WRITERS)
    writers = [context.Process(target=_write, args=(storage, i, start)) for i in range(WRITERS)]
    for p in writers:
        p.start()
    for p in writers:
        p.join(timeout=300)
    assert [p.exitcode for p in writers] == [0] * WRITERS
    store = _store(storage, WRITERS)
    index = store.index()
    found = [index.lookup("config", SOURCE, SourceFile(name=f"day-{i}.parquet", size=1000 + i, stamp=f"etag-{i}"))
             for i in range(WRITERS)]
    assert all(entry is not None and entry.segments[0].key == f"{i:064x}" for i, entry in enumerate(found)), found
    for fingerprint in [*(f"{i:016x}" for i in range(WRITERS)), SHARED]:
        folder = store.fetch_dataset(fingerprint)
        assert folder is not None, fingerprint
        assert DatasetManifest.from_json((folder / "manifest.json").read_bytes(), fingerprint).fingerprint == fingerprint
    if where == "s3":
        assert store.prime_catalog(SHARED) == 1  # one writer's catalog, whole
    else:
        assert len(SegmentCatalog.model_validate_json((store.local_root() / SHARED / CATALOG).read_bytes()).segments) == 1
