"""The source index shared by several writers: what each records survives the others."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from training.config import StorageConfig
from training.data.dataset_store import DatasetStore
from training.data.source_index import IndexedSegment, SourceIndex
from training.data.sources import SourceFile
from training.storage.root import StorageRoot

WRITERS = 8
SOURCE = "s3://incoming/daily"


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


@pytest.mark.parametrize("where", ["local", "s3"])
def test_eight_writers_racing_on_the_source_index_lose_nothing(where: str, tmp_path: Path,
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
