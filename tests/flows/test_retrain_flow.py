"""The whole flow under a real (test-harness) Prefect server."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from flows.retrain import retrain
from tests.kill import kill_worker_when
from training.config import RetrainConfig
from training.errors import ConfigError, Preempted
from training.pipeline.pack_stage import pack_stage
from training.pipeline.train_stage import run_key_for


def _report(path: str) -> dict:
    return json.loads(Path(path).read_text())


def _task_runs(flow_run_id) -> dict[str, object]:
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {r.name.rsplit("-", 1)[0]: r for r in runs}


def _artifacts(flow_run_id) -> dict[str, object]:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return {a.key: a for a in found}


def test_flow_runs_then_reuses_everything(small_config: RetrainConfig) -> None:
    state = retrain(small_config, return_state=True)
    first = _report(state.result())
    artifacts = _artifacts(state.state_details.flow_run_id)
    assert {"champion-challenger", "promotion-decision", "run-cost", "run-report", "training-progress"} <= set(artifacts)
    assert "PROMOTED" in artifacts["promotion-decision"].data
    assert artifacts["training-progress"].data == 100.0
    assert "data:image/png;base64," in artifacts["run-report"].data
    assert "naive run" in artifacts["run-cost"].data
    assert small_config.storage.root in artifacts["effective-config"].data  # the whole config, not the override
    curves = Path(first["files"]["curves_png"])
    from PIL import Image

    with Image.open(curves) as image:  # a valid PNG
        assert image.format == "PNG" and image.size[0] > 100
    assert Path(first["files"]["report_md"]).read_text().startswith("# Retrain run")
    assert first["cost"]["compute"]["billed_seconds"] > 0 and "naive" in first["cost"]
    assert first["utilization"]["verdict"] in ("data-bound", "memory-bound", "compute-bound")
    assert first["utilization"]["accelerator"]["memory_peak_bytes"] == "n/a"  # CPU: not invented
    assert first["status"] == "completed" and first["steps"] == 60
    assert set(first["metrics"]) == {"auc", "logloss", "accuracy"}
    assert first["stages"]["pack"]["reused"] is False
    assert first["stages"]["preprocess"]["state"] == "Completed"
    assert first["promotion"]["promoted"]
    for key in ("run_key", "model", "resumed_from_steps", "preemptions", "steps_lost", "durations", "cost"):
        assert key in first

    # As if interrupted between the promotion and the report (SIGINT in the report step): the
    # rerun reuses everything, writes the report, and it tells of the promotion this run made.
    (Path(_run_dir(small_config)) / "report.json").unlink()
    second = _report(retrain(small_config))
    assert second["stages"]["pack"]["reused"] is True
    assert second["stages"]["preprocess"]["state"] == "Cached"
    assert second["stages"]["train"]["already_complete"] is True
    assert second["model"] == first["model"]
    assert second["promotion"] == first["promotion"]

    # A finished run run again: no new promotion.
    third_state = retrain(small_config, return_state=True)
    third = _report(third_state.result())
    assert not third["promotion"]["promoted"] and "already the champion" in third["promotion"]["reason"]
    # Each flow run keeps its own report (report.json is the latest), under a name of its own.
    reports = [json.loads(p.read_text()) for p in (Path(_run_dir(small_config)) / "reports").glob("*.json")]
    ids = {r["prefect_flow_run_id"] for r in reports}
    assert len(reports) == 3 and ids == {first["prefect_flow_run_id"], second["prefect_flow_run_id"],
                                         third["prefect_flow_run_id"]}
    with get_client(sync_client=True) as client:
        names = {client.read_flow_run(s.state_details.flow_run_id).name for s in (state, third_state)}
    assert len(names) == 2, names


def _run_dir(config: RetrainConfig) -> str:
    packed = pack_stage(config)
    return str(Path(config.storage.root).resolve() / "runs" / run_key_for(config, packed.fingerprint))


@pytest.mark.slow
def test_killed_training_process_is_retried_and_resumes(small_config: RetrainConfig) -> None:
    small_config.train.max_steps = 300
    small_config.train.checkpoint.every = 10
    run_dir = _run_dir(small_config)
    kill_worker_when(run_dir, step=45)
    state = retrain(small_config, return_state=True)
    report = _report(state.result())
    assert report["status"] == "completed" and report["steps"] == 300
    # Resumed from a checkpoint, not from the start. Which one depends on when the outside killer
    # lands (beside another busy process, a few checkpoints after step 45) and on background
    # checkpoint writes (the newest *published* one may be one or two behind the kill).
    assert report["preemptions"] == 1 and 0 < report["resumed_from_steps"][0] < 300
    train_run = _task_runs(state.state_details.flow_run_id)["train"]
    assert train_run.run_count == 2  # first attempt killed, the retry resumed


@pytest.mark.slow
def test_rerun_after_the_flow_failed_resumes_from_the_checkpoint(small_config: RetrainConfig) -> None:
    small_config.train.max_steps = 300
    small_config.train.checkpoint.every = 10
    small_config.train.retry.max_retries = 0
    run_dir = _run_dir(small_config)
    kill_worker_when(run_dir, step=45)
    with pytest.raises(Preempted):
        retrain(small_config)
    report = _report(retrain(small_config))
    assert report["status"] == "completed"
    assert report["stages"]["pack"]["reused"] and report["stages"]["preprocess"]["state"] == "Cached"
    assert report["resumed_from_steps"] and 0 < report["resumed_from_steps"][0] < 300  # from a checkpoint


def test_a_bug_is_not_retried(small_config: RetrainConfig) -> None:
    small_config.model.factory = "tests.model_factories:wrong_shape"
    state = retrain(small_config, return_state=True)
    assert state.is_failed()
    train_run = _task_runs(state.state_details.flow_run_id)["train"]
    assert train_run.run_count == 1
    with pytest.raises(RuntimeError, match=r"failed: \w+Error: .*\(a bug: its traceback is in the training log"):
        state.result()


def test_a_user_model_factory_trains(small_config: RetrainConfig) -> None:
    small_config.model.factory = "tests.model_factories:linear"
    small_config.train.optim.lr = 0.05
    report = _report(retrain(small_config))
    assert report["status"] == "completed" and report["metrics"]["auc"] > 0.6


def test_a_home_relative_root_is_expanded(small_config: RetrainConfig, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    small_config.storage.root = "~/retrain-root"  # as deployments/prefect.yaml says
    report = retrain(small_config)
    assert Path(report).is_relative_to(tmp_path / "home" / "retrain-root")
    assert (tmp_path / "home" / "retrain-root" / "preprocess").exists()
    assert not (tmp_path / "~").exists()


def test_whole_flow_on_s3_then_a_fresh_machine_reuses_everything(
    s3_bucket: str, s3_server: str, demo_source: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Every stage on s3://; a second machine (empty local dir) finds the dataset, the cached
    preprocessing, the finished run and the champion there, and every object carries its tags."""
    import boto3

    from tests.conftest import S3_SECRET, s3_overrides, small_overrides
    from training.config import load_config

    def config_for(machine: str) -> RetrainConfig:
        return load_config(overrides=small_overrides(tmp_path / "unused", demo_source)
                           + s3_overrides(s3_bucket, s3_server, tmp_path / machine))

    state = retrain(config_for("machine-a"), return_state=True)
    first = _report(state.result())
    assert first["status"] == "completed" and first["promotion"]["promoted"]
    assert first["storage"]["root"] == f"s3://{s3_bucket}/team/retrain" and first["storage"]["remote"]

    raw = boto3.client("s3", endpoint_url=s3_server)
    keys = [o["Key"] for page in raw.get_paginator("list_objects_v2").paginate(Bucket=s3_bucket)
            for o in page.get("Contents", [])]
    run = f"team/retrain/runs/{first['run_key']}"
    fp = first["stages"]["pack"]["dataset"]
    expected = {
        f"team/retrain/datasets/{fp}/manifest.json": "shard-cache",
        f"{run}/result.json": "run",
        f"{run}/report.json": "run",
        f"{run}/model/model.pt": "model",
        f"team/retrain/models/{first['model']['sha256']}/model.pt": "model",
        "team/retrain/models/champion": "model",
    }
    assert set(expected) <= set(keys), sorted(keys)
    checkpoints = [k for k in keys if k.startswith(f"{run}/checkpoints/")]
    shards = [k for k in keys if k.startswith("team/retrain/datasets/segments/") and k.endswith(".tar")]
    stats = [k for k in keys if k.startswith("team/retrain/preprocess/")]
    assert checkpoints and shards and stats
    assert not [k for k in keys if k.startswith("team/retrain/prefect/")]  # no pickled Prefect results on S3
    expected.update({checkpoints[0]: "checkpoint", shards[0]: "shard-cache", stats[0]: "cache"})
    for key, cls in expected.items():
        tags = {t["Key"]: t["Value"] for t in raw.get_object_tagging(Bucket=s3_bucket, Key=key)["TagSet"]}
        assert tags["retrain-class"] == cls and tags["team"] == "ranking" and tags["project"] == "ctr", key
    ckpt_tags = {t["Key"]: t["Value"] for t in raw.get_object_tagging(Bucket=s3_bucket, Key=checkpoints[0])["TagSet"]}
    assert ckpt_tags["retrain-run"] == first["run_key"]
    rules = [r["ID"] for r in raw.get_bucket_lifecycle_configuration(Bucket=s3_bucket)["Rules"]]
    assert "retrain:team/retrain:checkpoints" in rules

    second_state = retrain(config_for("machine-b"), return_state=True)
    second = _report(second_state.result())
    assert second["stages"]["pack"]["reused"] is True
    assert second["stages"]["preprocess"]["state"] == "Cached"
    assert second["stages"]["train"]["already_complete"] is True
    assert second["model"]["sha256"] == first["model"]["sha256"]
    assert second["promotion"]["reason"] == "this model is already the champion"
    # Nothing trained there: evaluation streamed the test shards down, and no train shard.
    assert not list((tmp_path / "machine-b").rglob("train-*.tar"))
    assert list((tmp_path / "machine-b").rglob("test-*.tar"))

    # No credentials in anything the run wrote or showed.
    for report_path in (state.result(), second_state.result()):
        assert S3_SECRET not in Path(report_path).read_text()
    for artifact in _artifacts(state.state_details.flow_run_id).values():
        assert S3_SECRET not in str(artifact.data)
    out, err = capfd.readouterr()  # Prefect's logs and the training process's stderr
    assert S3_SECRET not in out + err and "AKIATESTKEYNEVERPRINT" not in out + err


def test_flow_on_s3_with_credentials_from_a_prefect_block(
    s3_bucket: str, s3_server: str, demo_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No credentials in the environment: the flow takes them from an AwsCredentials block."""
    from prefect_aws import AwsCredentials

    from tests.conftest import s3_overrides, small_overrides
    from training.config import load_config

    AwsCredentials(aws_access_key_id="AKIATESTKEYNEVERPRINT", aws_secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
                   region_name="us-east-1").save("retrain-test-creds", overwrite=True)
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var)
    config = load_config(overrides=small_overrides(tmp_path / "unused", demo_source)
                         + s3_overrides(s3_bucket, s3_server, tmp_path / "machine")
                         + ["storage.credentials_block=retrain-test-creds", "train.max_steps=20"])
    report = _report(retrain(config))
    assert report["status"] == "completed" and report["storage"]["remote"]


def _dataset_files(root: Path, fingerprint: str) -> dict[str, bytes]:
    """A dataset's manifest and every file of its segments, by path under datasets/."""
    manifest = json.loads((root / "datasets" / fingerprint / "manifest.json").read_text())
    folders = [root / "datasets" / "segments" / s["key"] for s in manifest["segments"]]
    files = [root / "datasets" / fingerprint / "manifest.json", *(p for f in folders for p in sorted(f.iterdir()))]
    return {str(p.relative_to(root / "datasets")): p.read_bytes() for p in files}


def test_flow_fans_packing_out_over_segments_byte_identical_to_serial(demo_source: Path, tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    from tests.conftest import small_overrides
    from training.config import load_config

    source = tmp_path / "multi"
    source.mkdir()
    table = pq.read_table(demo_source)
    half = table.num_rows // 2
    pq.write_table(table.slice(0, half), source / "a.parquet", row_group_size=1000)
    pq.write_table(table.slice(half), source / "b.parquet", row_group_size=1000)
    segmented = ["data.segment_rows=2000", "train.max_steps=20"]
    config = load_config(overrides=small_overrides(tmp_path / "flow", source) + ["data.pack_parts=3", *segmented])
    state = retrain(config, return_state=True)
    report = _report(state.result())
    runs = _task_runs(state.state_details.flow_run_id)
    with get_client(sync_client=True) as client:
        all_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    segment_runs = [r for r in all_runs if r.name.startswith("pack-")and r.name not in ("pack", "pack-plan")
                    and "parquet" in r.name]
    assert len(segment_runs) == 4 and all(r.state.is_completed() for r in segment_runs)
    assert {"pack-plan", "pack"} <= set(runs)

    serial = pack_stage(load_config(overrides=small_overrides(tmp_path / "serial", source) + segmented))
    assert report["stages"]["pack"]["dataset"] == serial.fingerprint
    assert _dataset_files(tmp_path / "flow", serial.fingerprint) == _dataset_files(tmp_path / "serial",
                                                                                   serial.fingerprint)


def test_packing_starts_the_next_segment_as_soon_as_any_finishes(demo_source: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Two slots, four segments, the first held until the other three are packed: that only
    finishes when a freed slot takes the next segment at once (waves of two would wait for the
    held one forever), and never more than two run together."""
    import threading

    import pyarrow.parquet as pq
    from prefect import flow

    import tasks.pack
    from tests.conftest import small_overrides
    from training.config import load_config

    source = tmp_path / "src"
    source.mkdir()
    pq.write_table(pq.read_table(demo_source).slice(0, 8000), source / "a.parquet", row_group_size=1000)
    config = load_config(overrides=small_overrides(tmp_path / "root", source)
                         + ["data.segment_rows=2000", "data.pack_parts=2"])
    real, lock, others_done = tasks.pack.pack_segment_stage, threading.Lock(), threading.Event()
    running, most, finished = [0], [0], []

    def held_first(config: RetrainConfig, plan):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            if plan.file_row == 0 and not others_done.wait(timeout=120):
                raise AssertionError("the other segments never started while the first was held")
            return real(config, plan)
        finally:
            with lock:
                running[0] -= 1
                finished.append(plan.file_row)
                if len(finished) == 3 and 0 not in finished:
                    others_done.set()

    monkeypatch.setattr(tasks.pack, "pack_segment_stage", held_first)
    packed = flow(name="pack-window")(tasks.pack.pack_dataset)(config)
    assert packed.segments_packed == 4 and finished[-1] == 0 and most[0] == 2
    serial = pack_stage(load_config(overrides=small_overrides(tmp_path / "serial", source) + ["data.segment_rows=2000"]))
    assert packed.fingerprint == serial.fingerprint


def _wait(predicate, timeout: float = 30.0):  # logs and events reach the server in batches
    import time

    deadline = time.time() + timeout
    while True:
        value = predicate()
        if value or time.time() > deadline:
            return value
        time.sleep(0.5)


@pytest.mark.slow
def test_training_warnings_the_run_id_and_the_promotion_event_reach_prefect(small_config: RetrainConfig) -> None:
    import signal

    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.events.filters import EventFilter, EventNameFilter

    small_config.train.max_steps = 200
    small_config.train.checkpoint.every = 10
    kill_worker_when(_run_dir(small_config), step=45, sig=signal.SIGTERM)  # the child logs a warning
    state = retrain(small_config, return_state=True)
    report = _report(state.result())
    run_id = state.state_details.flow_run_id
    assert report["prefect_flow_run_id"] == str(run_id) and report["promotion"]["promoted"]

    def warnings() -> list[str]:
        with get_client(sync_client=True) as client:
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
        return [log.message for log in logs if log.level >= 30 and log.task_run_id is not None]

    assert any(m.startswith("preempted:") for m in _wait(warnings)), warnings()

    def promoted() -> list:
        with get_client(sync_client=True) as client:
            page = client.read_events(EventFilter(event=EventNameFilter(name=["retrain.model.promoted"])), limit=50)
        return [e for e in page.events if e.payload.get("sha256") == report["model"]["sha256"]]

    (event,) = _wait(promoted)
    assert event.resource.id == f"retrain.model.{report['model']['sha256']}"
    assert event.payload["auc"] == pytest.approx(report["metrics"]["auc"])


class _Marker:
    """Unpickling this writes a file: proof that code from the storage root ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path(self.path).touch, ())


def test_nothing_read_back_from_the_root_is_unpickled(small_config: RetrainConfig, tmp_path: Path) -> None:
    import pickle

    root = Path(small_config.storage.root)
    first = _report(retrain(small_config))
    assert first["stages"]["preprocess"]["state"] == "Completed"
    assert not (root / "prefect" / "results").exists()  # Prefect persists no (cloudpickled) results here
    marker = tmp_path / "code-ran"
    payload = pickle.dumps(_Marker(str(marker)))
    # Whatever an attacker with write access could replace: every file Prefect might read back.
    planted = [p for p in (root / "prefect").rglob("*") if p.is_file()] if (root / "prefect").exists() else []
    for path in planted + [root / "prefect" / "results" / "result", root / "prefect" / "cache-keys" / "key"]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(payload)
    second = _report(retrain(small_config))
    assert not marker.exists()
    assert second["stages"]["preprocess"]["state"] == "Cached"  # reused, verified by its sha256


@pytest.mark.slow
def test_packing_on_a_dask_cluster_that_shares_no_folder_is_byte_identical_to_serial(
        s3_bucket: str, s3_server: str, demo_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The flow packing on a dask.distributed cluster of two worker processes named by
    `data.pack_cluster`, each with its own home and so its own storage.local_dir, the source and
    the storage root on S3 (moto's server): the workers read the new files' footers, pack the
    segments and publish them themselves, the flow's machine never holds a shard, and the
    dataset on S3 is byte for byte the one a single process packs."""
    import boto3
    import pyarrow.parquet as pq
    from distributed import Nanny, Scheduler, SpecCluster

    from tests.conftest import s3_overrides, small_overrides
    from training.config import load_config

    raw = boto3.client("s3", endpoint_url=s3_server)
    table = pq.read_table(demo_source)
    for i in range(3):
        pq.write_table(table.slice(i * 2000, 2000), tmp_path / f"day-{i}.parquet", row_group_size=500)
        raw.upload_file(str(tmp_path / f"day-{i}.parquet"), s3_bucket, f"incoming/day-{i}.parquet")
    homes = {name: tmp_path / f"home-{name}" for name in ("flow", "w0", "w1", "serial")}
    monkeypatch.setenv("HOME", str(homes["flow"]))  # storage.local_dir unset: each machine's own ~/.cache

    def config_for(prefix: str, *more: str) -> RetrainConfig:
        s3 = [o for o in s3_overrides(s3_bucket, s3_server, tmp_path / "unused", prefix) if "local_dir" not in o]
        return load_config(overrides=small_overrides(tmp_path / "unused", demo_source) + s3 + [
            f"data.source=s3://{s3_bucket}/incoming/", "data.segment_rows=1000", "data.pack_parts=4",
            "train.max_steps=20", *more])

    workers = {name: {"cls": Nanny, "options": {"nthreads": 1, "env": {"HOME": str(homes[name])}}}
               for name in ("w0", "w1")}
    with SpecCluster(scheduler={"cls": Scheduler, "options": {"dashboard_address": None}}, workers=workers) as cluster:
        report = _report(retrain(config_for("flow", f"data.pack_cluster={cluster.scheduler_address}")))
        ran = set(cluster.scheduler.task_prefixes)  # what the cluster ran, by the task's name
    assert {"plan_files", "pack_segment"} <= ran  # the footers were read there, not on the flow's machine
    assert report["stages"]["pack"]["segments"] == 6
    for name in ("w0", "w1"):  # each worker packed into its own folder
        assert list(homes[name].rglob("segments/*/train-*.tar")), name
    adopted = list(homes["flow"].rglob("segments/*/segment.json"))
    assert len(adopted) == 6 and all((p.parent / "remote.json").exists() for p in adopted)  # none packed here

    monkeypatch.setenv("HOME", str(homes["serial"]))
    serial = pack_stage(config_for("serial"))
    assert report["stages"]["pack"]["dataset"] == serial.fingerprint

    def objects(prefix: str) -> dict[str, bytes]:
        keys = [o["Key"] for page in raw.get_paginator("list_objects_v2").paginate(
            Bucket=s3_bucket, Prefix=f"{prefix}/datasets/") for o in page.get("Contents", [])]
        return {k.removeprefix(f"{prefix}/"): raw.get_object(Bucket=s3_bucket, Key=k)["Body"].read()
                for k in keys if "source-index" not in k}

    flow, single = objects("flow"), objects("serial")
    assert flow == single and len(flow) > 30


def test_a_run_with_nothing_new_keeps_the_champion_says_why_and_trains_nothing(small_config: RetrainConfig) -> None:
    from training.pipeline.reports.run_report import KeptReport, read_report

    first = _report(retrain(small_config))
    assert first["promotion"]["promoted"]
    small_config.train.retrain_when = "drift"
    small_config.train.max_steps = 80  # another run key: without the check, this would train
    state = retrain(small_config, return_state=True)
    kept = read_report(Path(state.result()))
    assert isinstance(kept, KeptReport) and Path(state.result()).parent.name == "kept"
    assert kept.decision.reason == "no data new since the champion was trained" and not kept.decision.train
    assert kept.champion is not None and kept.champion.sha256 == first["model"]["sha256"]
    runs = _task_runs(state.state_details.flow_run_id)
    assert {"pack-plan", "pack", "decide", "keep-champion"} <= set(runs) and "train" not in runs
    assert "keeps the champion" in str(_artifacts(state.state_details.flow_run_id)["training-decision"].data)


def test_a_run_takes_the_plans_pick_and_its_step_time_calibrates_the_next_plan(small_config: RetrainConfig) -> None:
    """`retrain plan` stores its pick; a run with `cost.instance_type: auto` takes it, reports its
    measured step time against the prediction, and, having run on that instance type's device,
    stores it: the next plan uses the measurement instead of this machine's calibration."""
    from training.pipeline.plan_stage import plan_run
    from training.registry.step_times import StepTimeBook, resolve_planned_instance
    from training.storage.root import StorageRoot

    auto = small_config.model_copy(deep=True)
    auto.cost.instance_type = "auto"
    with pytest.raises(ConfigError, match="no plan is stored"):
        resolve_planned_instance(auto)
    first = plan_run(small_config, ["local-cpu", "c6i.large"], deadline_hours=1.0, calibration_steps=10)
    # This machine is shown, never the instance to rent.
    assert first.cheapest is not None and first.cheapest.instance_type == "c6i.large"
    assert [r.market for r in first.rows if r.instance_type == "local-cpu"] == ["this machine"]
    assert first.calibration.here.load_seconds_per_batch is not None  # the host limit was measured
    assert "CPU time" in first.cheapest.step_source

    report = _report(retrain(auto))
    assert report["cost"]["instance_type"] == "c6i.large" and report["cost"]["market"] == first.cheapest.market
    step_time = report["step_time"]
    assert step_time["recorded"] and step_time["device"] == "cpu" and step_time["actual_seconds"] > 0
    assert step_time["predicted_seconds"] is None  # no GPU figures for a CPU instance: nothing predicted
    book = StepTimeBook.load(StorageRoot.from_config(small_config))
    assert [r.run_key for r in book.records] == [report["run_key"]]

    again = plan_run(small_config, ["c6i.large"], deadline_hours=1.0, calibration_steps=10)
    row = next(r for r in again.rows if r.market == first.cheapest.market)
    assert row.step_source == "measured on the instance by an earlier run"
    assert row.step_seconds == (step_time["actual_seconds"],) * 3


def test_the_plan_flow_puts_its_ranked_table_in_the_ui(small_config: RetrainConfig) -> None:
    from flows.plan import plan

    state = plan(["local-cpu", "c6i.large", "g5.xlarge", "g4dn.xlarge"], 1.0, 5, small_config, return_state=True)
    assert state.result() == "c6i.large"  # a small model: a CPU instance; this machine is never the pick
    artifacts = _artifacts(state.state_details.flow_run_id)
    table = json.loads(artifacts["plan-instances"].data)
    assert table[0]["instance"] == "c6i.large" and table[-1]["market"] == "this machine"
    gpu = next(r for r in table if r["instance"] == "g5.xlarge" and r["market"] == "spot")
    assert gpu["fits"] == "yes" and gpu["step time"].startswith("predicted: A10G") and "(" in gpu["ms/step"]
    assert "c6i.large (" in artifacts["plan-recommendation"].data


def test_a_budget_stop_is_in_the_flow_runs_state_message(small_config: RetrainConfig) -> None:
    """A run the budget cut short ends Completed, as it should (its model is usable), and its
    state message says the budget stopped it: the UI shows that beside the run."""
    small_config.train.max_steps = 100_000
    small_config.train.patience = 0
    small_config.budget.max_wall_seconds = 1.0  # pack and preprocess count too: over at the first validation
    state = retrain(small_config, return_state=True)
    report = _report(state.result())
    assert report["status"] == "budget_stopped" and state.is_completed()
    assert state.message is not None and state.message.startswith(f"budget stopped at step {report['steps']}:")
    assert "budget.max_wall_seconds" in state.message and state.result() in state.message


@pytest.mark.parametrize("kind", ["regression", "multiclass"])
def test_a_run_given_only_source_and_label_infers_the_task_from_the_label(tmp_path: Path, kind: str) -> None:
    """`retrain run --set data.source=<file> --set data.label=<column>` on a float label (named
    like one of the demo's columns) trains a regression, on a string label a multiclass model."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.conftest import small_overrides
    from training.config import load_config

    rng = np.random.default_rng(0)
    x1, x2 = rng.normal(size=3000), rng.normal(size=3000)
    if kind == "regression":
        label, values = "price", 3.0 * x1 - x2 + rng.normal(size=3000) * 0.3
    else:
        label, values = "colour", np.array(["red", "green", "blue"])[np.digitize(x1 + 0.3 * x2, [-0.5, 0.5])]
    source = tmp_path / "mine.parquet"
    pq.write_table(pa.table({"x1": x1, "x2": x2, label: values}), source)
    config = load_config(overrides=[*small_overrides(tmp_path / "root", source), f"data.label={label}"])
    report = _report(retrain(config, return_state=True).result())
    assert report["task"] == kind, report.get("task")
    metric, better = ("r2", 0.8) if kind == "regression" else ("accuracy", 0.7)
    assert report["metrics"][metric] > better, report["metrics"]


def test_a_run_given_only_source_and_label_infers_the_feature_columns(tmp_path: Path) -> None:
    """A deployment's run started from the UI with a user's own file and its label, as
    `retrain run` would be: the flow infers the feature columns from the schema and trains, and
    the run's effective config (an artifact) holds what it inferred."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.conftest import small_overrides
    from training.config import load_config

    rng = np.random.default_rng(0)
    x1, x2 = rng.normal(size=3000), rng.normal(size=3000)
    shop = rng.choice(["a", "b", "c"], size=3000)
    y = (x1 + 0.5 * x2 + (shop == "a") + rng.normal(size=3000) * 0.5 > 0.5).astype(np.int8)
    source = tmp_path / "mine.parquet"
    pq.write_table(pa.table({"x1": x1, "x2": x2, "shop": shop, "y": y}), source)
    config = load_config(overrides=[*small_overrides(tmp_path / "root", source), "data.label=y"])
    state = retrain(config, return_state=True)
    report = _report(state.result())
    assert report["metrics"]["auc"] > 0.7
    effective = str(_artifacts(state.state_details.flow_run_id)["effective-config"].data)
    assert "x1" in effective and "shop" in effective
