"""MLflow tracking and registry against a real `mlflow server` (SQLite backend) on 127.0.0.1:
one MLflow run per run key through a kill and a resume, aliases that follow the champion
pointer, an alias someone else owns left alone, and a server that dies mid-run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest

from flows.retrain import retrain
from tests.kill import kill_worker_when
from tests.mlflow_server import MlflowServer
from training.config import RetrainConfig, load_config
from training.pipeline.pack_stage import pack_stage
from training.pipeline.train_stage import run_key_for
from training.registry.champion import champion_of
from training.storage.root import StorageRoot
from training.registry.tracking import TAG_RUN_KEY

pytest.importorskip("mlflow")
MODEL = "retrain-model"


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """One server for the module; the last test kills it (starting another costs 7 s)."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow")).start()
    yield server
    server.stop()


@pytest.fixture
def mlflow_url(mlflow_server: MlflowServer) -> str:
    return mlflow_server.url


def _client(url: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=url, registry_uri=url)


def _config(root: Path, source: Path, url: str, *extra: str) -> RetrainConfig:
    from tests.conftest import small_overrides

    return load_config(overrides=[*small_overrides(root, source), f"tracking.mlflow_uri={url}",
                                  "cost.tags={team: ranking}", *extra])


def _run_dir(config: RetrainConfig) -> str:
    return str(StorageRoot.from_config(config).local / "runs" / run_key_for(config, pack_stage(config).fingerprint))


def _runs_of(url: str, run_key: str) -> list:
    client = _client(url)
    experiment = client.get_experiment_by_name("retrain")
    return client.search_runs([experiment.experiment_id], filter_string=f"tags.`{TAG_RUN_KEY}` = '{run_key}'")


def test_a_killed_and_resumed_run_is_one_mlflow_run_then_aliases_follow_the_champion(
        mlflow_url: str, tmp_path: Path, demo_source: Path) -> None:
    config = _config(tmp_path / "root", demo_source, mlflow_url, "train.max_steps=120", "train.checkpoint.every=10")
    kill_worker_when(_run_dir(config), step=45)
    report = json.loads(Path(retrain(config)).read_text())
    assert report["preemptions"] == 1 and report["promotion"]["promoted"]
    assert report["stages"]["train"]["threads"]["threads"] >= 1  # the thread policy, reported

    (run,) = _runs_of(mlflow_url, report["run_key"])  # the retry continued it: no second run
    client = _client(mlflow_url)
    # Each validation once, the replayed one too. MLflow's history promises no order: compare sorted.
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "val_auc"))
    assert steps == [20, 40, 60, 80, 100, 120]
    assert run.data.params["train.max_steps"] == "120" and run.data.params["data.label"] == '"clicked"'
    assert run.data.metrics["test_auc"] == pytest.approx(report["metrics"]["auc"])
    assert run.data.metrics["cost_usd"] == pytest.approx(report["cost"]["total_usd"])
    assert run.data.tags["cost.team"] == "ranking" and run.data.tags["prefect.flow_run_id"]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"report.md", "curves.png", "model"} <= artifacts
    exported = {a.path for a in client.list_artifacts(run.info.run_id, "model/export")}
    assert exported == {"model/export/model.pt2", "model/export/preprocess.json"}
    champion = client.get_model_version_by_alias(MODEL, "champion")
    assert champion.run_id == run.info.run_id
    assert client.get_model_version_by_alias(MODEL, "challenger").version == champion.version
    assert report["tracking"]["problems"] == [] and report["tracking"]["aliases"] == ["challenger", "champion"]

    # A rejected challenger: a new version with `challenger`, and `champion` where it was.
    rejected = _config(tmp_path / "root", demo_source, mlflow_url, "train.max_steps=40", "eval.min_delta=0.5")
    second = json.loads(Path(retrain(rejected)).read_text())
    assert not second["promotion"]["promoted"]
    challenger = client.get_model_version_by_alias(MODEL, "challenger")
    assert challenger.version != champion.version and challenger.run_id == second["tracking"]["run_id"]
    assert client.get_model_version_by_alias(MODEL, "champion").version == champion.version
    assert second["tracking"]["aliases"] == ["challenger"]


def test_a_rerun_that_trains_nothing_records_the_whole_run_and_the_champion_alias(
        mlflow_url: str, tmp_path: Path, demo_source: Path) -> None:
    """Trained and promoted without tracking, then rerun with it: nothing is trained, and the
    MLflow run still holds the config and every validation, and its version the champion alias."""
    from tests.conftest import small_overrides

    untracked = load_config(overrides=[*small_overrides(tmp_path / "root", demo_source), "train.max_steps=40"])
    first = json.loads(Path(retrain(untracked)).read_text())
    assert first["promotion"]["promoted"] and first.get("tracking") is None
    tracked = _config(tmp_path / "root", demo_source, mlflow_url, "train.max_steps=40",
                      "tracking.registered_model=rerun-model")
    again = json.loads(Path(retrain(tracked)).read_text())
    assert again["stages"]["train"]["already_complete"] and again["run_key"] == first["run_key"]
    (run,) = _runs_of(mlflow_url, again["run_key"])
    client = _client(mlflow_url)
    assert run.data.params["train.max_steps"] == "40"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "val_auc")) == [20, 40]
    champion = client.get_model_version_by_alias("rerun-model", "champion")
    assert champion.run_id == run.info.run_id and again["tracking"]["aliases"] == ["challenger", "champion"]


CHROMIUM = "/usr/bin/chromium"


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed (.ci/run installs it)")
def test_the_mlflow_ui_shows_the_run_and_the_champion_alias(mlflow_url: str, tmp_path: Path) -> None:
    """What a pipeline run leaves in MLflow (a run with its test metrics, its model as the
    champion version), made here so the test depends on no other. The screenshot is the
    README's (docs/mlflow-ui.png is a copy of one)."""
    from playwright.sync_api import sync_playwright

    from tests.e2e.conftest import ROOT
    from training.config import TrackingConfig
    from training.registry.tracking import MlflowTracker, register_model

    artifacts = ROOT / "test-artifacts"
    artifacts.mkdir(exist_ok=True)
    name = "ui-model"
    tracker = MlflowTracker(TrackingConfig(mlflow_uri=mlflow_url, registered_model=name), mlflow_url, "c" * 16,
                            tmp_path / "run")
    tracker.log_metrics({"test_auc": 0.8123}, 0, "the test metrics")
    register_model(tracker, _package(tmp_path), "3" * 64, is_champion=True)
    champion = _client(mlflow_url).get_model_version_by_alias(name, "champion")
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(f"{mlflow_url}/#/models/{name}")
        page.get_by_text("Model training").first.click()  # not the GenAI view of runs
        assistant = page.get_by_role("button", name="Close")
        if assistant.count():
            assistant.first.click()
        page.get_by_text("@ champion").first.wait_for(timeout=60_000)
        page.get_by_text(f"Version {champion.version}").first.wait_for()
        page.screenshot(path=str(artifacts / "mlflow-ui-model.png"))
        page.goto(f"{mlflow_url}/#/experiments/{_client(mlflow_url).get_experiment_by_name('retrain').experiment_id}"
                  f"/runs/{champion.run_id}")
        page.get_by_text("test_auc").first.wait_for(timeout=60_000)
        page.screenshot(path=str(artifacts / "mlflow-ui-run.png"))
        browser.close()


def test_a_champion_alias_someone_else_set_is_not_moved(mlflow_url: str, tmp_path: Path) -> None:
    from training.config import TrackingConfig
    from training.registry.tracking import MlflowTracker, register_model

    client = _client(mlflow_url)
    name = "shared-model"
    client.create_registered_model(name)
    theirs = client.create_model_version(name, source="s3://elsewhere/model")  # registered by hand
    client.set_registered_model_alias(name, "champion", theirs.version)
    package = tmp_path / "package"
    package.mkdir()
    (package / "model.json").write_text("{}")
    tracker = MlflowTracker(TrackingConfig(mlflow_uri=mlflow_url, registered_model=name), mlflow_url, "k" * 16,
                            tmp_path / "run")
    register_model(tracker, package, "0" * 64, is_champion=True)
    assert client.get_model_version_by_alias(name, "champion").version == theirs.version
    assert tracker.notes.aliases == ["challenger"]
    (problem,) = tracker.notes.problems
    assert f"not moved: it is on version {theirs.version} of 'shared-model', which this pipeline did not register" in problem


def _package(tmp_path: Path) -> Path:
    package = tmp_path / "package"
    package.mkdir(exist_ok=True)
    (package / "model.json").write_text("{}")
    return package


def test_a_foreign_run_id_in_tracking_json_is_not_used(mlflow_url: str, tmp_path: Path) -> None:
    """tracking.json is root input: a run id planted there must not receive this run's metrics,
    model or aliases."""
    from training.config import TrackingConfig
    from training.registry.tracking import MlflowTracker, register_model

    client = _client(mlflow_url)
    experiment = client.get_experiment_by_name("retrain") or client.get_experiment(client.create_experiment("retrain"))
    foreign = client.create_run(experiment.experiment_id, tags={TAG_RUN_KEY: "f" * 16, "owner": "someone else"})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "tracking.json").write_text(json.dumps({"uri": mlflow_url, "run_id": foreign.info.run_id}))
    name = "planted-model"
    tracker = MlflowTracker(TrackingConfig(mlflow_uri=mlflow_url, registered_model=name), mlflow_url, "a" * 16, run_dir)
    register_model(tracker, _package(tmp_path), "1" * 64, is_champion=True)

    ours = tracker.notes.run_id
    assert ours is not None and ours != foreign.info.run_id
    assert client.get_run(ours).data.tags[TAG_RUN_KEY] == "a" * 16
    assert client.get_model_version_by_alias(name, "champion").run_id == ours
    assert client.search_model_versions(f"name = '{name}' and run_id = '{foreign.info.run_id}'") == []
    assert any("not run key" in p for p in tracker.notes.problems)


def test_a_version_whose_source_or_sha_differs_is_not_aliased(mlflow_url: str, tmp_path: Path) -> None:
    from training.config import TrackingConfig
    from training.registry.tracking import MlflowTracker, register_model

    name, key = "edited-model", "b" * 16
    tracker = MlflowTracker(TrackingConfig(mlflow_uri=mlflow_url, registered_model=name), mlflow_url, key,
                            tmp_path / "run")
    run_id = tracker.run_id()
    client = _client(mlflow_url)
    client.create_registered_model(name)
    edited = client.create_model_version(name, source="s3://elsewhere/model", run_id=run_id,
                                         tags={TAG_RUN_KEY: key, "retrain.sha256": "2" * 64})
    register_model(tracker, _package(tmp_path), "2" * 64, is_champion=True)
    champion = client.get_model_version_by_alias(name, "champion")
    assert champion.version != edited.version and champion.source.endswith("/model")
    assert champion.source != "s3://elsewhere/model" and champion.tags["retrain.sha256"] == "2" * 64
    assert any("another source or sha256" in p for p in tracker.notes.problems)

    again = MlflowTracker(TrackingConfig(mlflow_uri=mlflow_url, registered_model=name), mlflow_url, key,
                          tmp_path / "run")
    register_model(again, _package(tmp_path), "2" * 64, is_champion=True)  # a retry finds the good version
    assert again.notes.model_version == champion.version


def test_a_fresh_sqlite_store_opened_by_several_processes_at_once_records_every_run(tmp_path: Path) -> None:
    import subprocess
    import sys

    uri = f"sqlite:///{tmp_path / 'fresh' / 'mlflow.db'}"
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from training.config import TrackingConfig\n"
        "from training.registry.tracking import MlflowTracker\n"
        "t = MlflowTracker(TrackingConfig(mlflow_uri=sys.argv[1]), sys.argv[1], sys.argv[2], Path(sys.argv[3]))\n"
        "print(t.run_id(), t.notes.problems)\n")
    procs = [subprocess.Popen([sys.executable, "-c", script, uri, f"{i:016x}", str(tmp_path / f"run{i}")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(3)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    assert all(out.strip().splitlines()[-1].endswith(" []") for out in outputs), outputs
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("retrain").experiment_id])
    assert len(runs) == 3


def test_mlflow_dying_mid_run_neither_fails_nor_stops_the_run(mlflow_server: MlflowServer, tmp_path: Path,
                                                             demo_source: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage functions the flow's tasks call (no Prefect: it adds nothing to this), with the
    server killed when the run sends the metrics of its validation at step 60 of 300 (at that
    moment, not at a time: a training step may take a millisecond or a second). Last in this
    file: the module's server dies here."""
    from training.registry import tracking
    from training.pipeline.evaluate_stage import evaluate_stage
    from training.pipeline.preprocess_stage import preprocess_stage
    from training.pipeline.handoffs import StageStates
    from training.pipeline.report_stage import report_stage
    from training.pipeline.train_stage import train_stage

    server = mlflow_server
    config = _config(tmp_path / "root", demo_source, server.url, "train.max_steps=300")
    log_metrics = tracking.MlflowTracker.log_metrics

    def server_dies_at_step_60(self: tracking.MlflowTracker, metrics: dict[str, float], step: int, what: str) -> None:
        if step >= 60:
            server.stop()
        log_metrics(self, metrics, step, what)

    monkeypatch.setattr(tracking.MlflowTracker, "log_metrics", server_dies_at_step_60)
    try:
        packed = pack_stage(config)
        prep = preprocess_stage(packed.dataset_dir, config.preprocess, config.storage)
        trained = train_stage(config, packed, prep, champion_of(config))
        evaluation = evaluate_stage(config, packed, trained)
        paths = report_stage(config, packed, prep, trained, evaluation, StageStates())
    finally:
        server.stop()
    report = json.loads(Path(paths.report).read_text())
    assert report["status"] == "completed" and report["steps"] == 300
    problems = report["tracking"]["problems"]
    assert any(p.startswith("validation metrics: not recorded") for p in problems), problems
    assert any(p.startswith("the registered model version: not recorded") for p in problems), problems
    markdown = Path(paths.markdown).read_text()
    assert "## MLflow" in markdown and "Not recorded:" in markdown
