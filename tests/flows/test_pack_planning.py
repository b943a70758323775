"""A source of many new files, planned on a Dask cluster: the pack-plan task on the flow's
machine lists the files and reads no footer; `plan_files` tasks on the workers read them, a
chunk of files each, and the plan is the one the flow's machine would have made."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from prefect import flow

from tasks.pack import _dask_runner, _planned_on, begin_packing
from tests.conftest import small_overrides
from training.config import RetrainConfig, load_config
from training.data.ingest.dataset_store import DatasetStore
from training.data.ingest.packing import plan_pack
from training.pipeline.pack_stage import PackBegun
from training.storage.root import StorageRoot

FILES = 100


@flow
def plan_on_the_cluster(config: RetrainConfig, address: str) -> PackBegun:
    """The pack stage's planning as `tasks.pack.pack_dataset` runs it with data.pack_cluster."""
    begun = begin_packing(config, defer_footers=True)
    assert begun.plan.source_bytes_read == 0 and len(begun.plan.unread) == FILES and not begun.plan.todo
    with _dask_runner(address) as runner:
        return _planned_on(runner, config, begun)


@pytest.mark.slow
def test_a_hundred_new_files_have_their_footers_read_on_the_cluster(demo_source: Path, tmp_path: Path) -> None:
    from distributed import LocalCluster

    source = tmp_path / "incoming"
    source.mkdir()
    table = pq.read_table(demo_source)
    for i in range(FILES):
        pq.write_table(table.slice(i * 60, 60), source / f"day-{i:03d}.parquet", row_group_size=30)
    config = load_config(overrides=small_overrides(tmp_path / "root", source) + ["data.segment_rows=1000"])

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        begun = plan_on_the_cluster(config, cluster.scheduler_address)
        ran = set(cluster.scheduler.task_prefixes)

    assert "plan_files" in ran  # the cluster read the footers
    here, _ = plan_pack(source, config.data, DatasetStore(StorageRoot(config.storage)), config.storage)
    assert begun.plan.todo == here.todo and len(here.todo) == FILES and not begun.plan.unread
    assert begun.plan.source_bytes_read == here.source_bytes_read > 0
