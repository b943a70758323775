"""Tasks called through .fn(), plus the retry policy against real Prefect states."""

from __future__ import annotations

from prefect.states import Failed

from tasks.pack import begin_packing, finish_packing, pack_segment
from tasks.policies import backoff, retry_only_preemptions, retry_transient
from tasks.preprocess import fit_features
from training.config import RetrainConfig
from training.pipeline.handoffs import PackResult
from training.errors import ConfigError, DataError, Preempted, StorageError


def _pack(config: RetrainConfig) -> PackResult:
    begun = begin_packing.fn(config)
    packed = [pack_segment.fn(config, plan) for plan in begun.plan.todo] if begun.done is None else []
    return finish_packing.fn(config, begun, packed)


def test_pack_and_preprocess_tasks(small_config: RetrainConfig) -> None:
    packed = _pack(small_config)
    assert packed.reused is False and packed.shards > 3
    first = fit_features.fn(packed.dataset_dir, small_config.preprocess, small_config.storage)
    assert first.name == "Completed" and first.result().stats_path.endswith("feature_stats.json")
    second = fit_features.fn(packed.dataset_dir, small_config.preprocess, small_config.storage)
    assert second.name == "Cached" and second.result().key == first.result().key
    again = _pack(small_config)
    assert again.reused is True and again.dataset_dir == packed.dataset_dir


def test_only_preemptions_are_retried() -> None:
    assert retry_only_preemptions(None, None, Failed(data=Preempted("spot reclaim")))
    for err in (ConfigError("x"), DataError("x"), RuntimeError("shape mismatch")):
        assert not retry_only_preemptions(None, None, Failed(data=err))


def test_backoff_doubles() -> None:
    assert backoff(5, 3) == [5, 10, 20]


def test_storage_errors_are_retried_only_when_transient() -> None:
    assert retry_transient(None, None, Failed(data=StorageError("endpoint did not answer", transient=True)))
    assert not retry_transient(None, None, Failed(data=StorageError("bucket 'x' does not exist")))
    assert not retry_transient(None, None, Failed(data=DataError("bad column")))


def test_the_score_task_skips_an_input_that_holds_nothing_yet(small_config: RetrainConfig, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The shipped predict deployment runs after every retrain; before the first file lands in
    its input folder, that is a skip with a clear line, not a failed run with a traceback. An
    input that does not exist at all is a mistake in the parameters: the run fails, in one line."""
    import pytest

    from tasks.score import score_parquet
    from training.errors import DataError

    empty = tmp_path / "empty"
    empty.mkdir()
    result = score_parquet.fn(small_config, str(empty), str(tmp_path / "scores.parquet"), "champion", None)
    assert result.skipped and result.rows == 0 and not (tmp_path / "scores.parquet").exists()
    with pytest.raises(DataError, match="incoming does not exist"):
        score_parquet.fn(small_config, str(tmp_path / "incoming"), str(tmp_path / "scores.parquet"), "champion", None)


def test_a_run_is_named_from_its_merged_config_and_keeps_its_name_when_rescheduled() -> None:
    import datetime

    from tasks.runtime import run_name

    now = datetime.datetime(2026, 11, 28, 3, 0, tzinfo=datetime.timezone.utc)
    deployment = {"config": {"data": {"source": "s3://bucket/clicks/daily/"}}}
    override = {"config": {"train": {"max_steps": 500}}}  # a UI run that changes one key
    assert run_name(override, deployment, None, "3f2a9d10", now) == "daily-2026-11-28-0300-3f2a"
    assert run_name({"config": {"data": {"source": "/data/other.parquet"}}}, deployment, None, "3f2a",
                    now) == "other-2026-11-28-0300-3f2a"
    assert run_name({}, {}, None, "", now) == "demo-2026-11-28-0300-local"
    later = now + datetime.timedelta(minutes=7)  # rescheduled after a spot reclaim: the same run
    assert run_name(override, deployment, "daily-2026-11-28-0300-3f2a", "3f2a9d10", later) == "daily-2026-11-28-0300-3f2a"


def test_a_promotion_notification_names_the_models_short_the_metric_rounded_and_the_flow_run() -> None:
    from tasks.artifacts import promotion_payload
    from training.pipeline.handoffs import Evaluation, Promotion

    new, old = "ab" * 32, "cd" * 32
    evaluation = Evaluation(tags={}, metrics={"rmse": 52.551234, "r2": 0.5012, "rows": 90.0}, task="regression",
                            metric="rmse", promotion=Promotion(promoted=True, reason="beats it", challenger_sha256=new,
                                                               champion_sha256=old), seconds=1.0)
    payload = promotion_payload(evaluation, {"flow_run_name": "daily-2026-11-29-0300-ab12", "deployment": "retrain",
                                             "flow_run_id": "ab12", "flow_run_url": None})
    assert payload["short"] == new[:12] and payload["previous_short"] == old[:12]
    assert payload["metric_text"] == "test rmse 52.5512" and payload["rmse"] == 52.551234 and "rows" not in payload
    assert payload["flow_run_name"] == "daily-2026-11-29-0300-ab12" and payload["deployment"] == "retrain"


def test_every_flow_and_task_has_a_timeout_and_trainings_follows_the_budget() -> None:
    """No hung run holds a worker for ever: each flow and task carries a backstop."""
    import importlib
    import pkgutil

    from prefect import Flow, Task

    import flows
    import tasks
    from tasks.policies import TRAIN_TIMEOUT, train_timeout

    found = []
    for package in (tasks, flows):
        for info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            found += [obj for obj in vars(module).values() if isinstance(obj, (Task, Flow)) and obj.__module__ == module.__name__]
    assert len(found) >= 20
    # Mapped and submitted tasks run in the task runner's worker threads, where a timeout cannot
    # interrupt them: the flow's bounds them.
    assert sorted(f.name for f in found if not f.timeout_seconds) == ["pack-plan-files", "pack-segment", "trial"]
    assert train_timeout(None) == TRAIN_TIMEOUT and train_timeout(3600) == 3 * 3600
