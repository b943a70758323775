"""MLflow tracking and the model registry, optional (`pip install '.[mlflow]'`).

On when `tracking.mlflow_uri` or MLFLOW_TRACKING_URI is set; otherwise nothing here runs.

- One MLflow run per run key, found by its tag `retrain.run_key`: a retry, a resume after a
  preemption or a rerun continues it and never opens a second one.
- The train stage logs the config (params) at the run's creation and each validation's train
  loss and metrics with their step, from a background thread: MLflow is never on the training
  path. The report stage logs the test metrics, cost, cost tags, the Prefect flow run and the
  report's files. The evaluate stage registers the model package (with its portable export) as
  a version of `tracking.registered_model`, sets the alias `challenger` on it, and moves
  `champion` exactly when the pipeline's own champion pointer moves.
- MLflow being down or refusing never fails or slows a run: a request has
  `tracking.timeout_seconds` and no retries, the first failure switches tracking off for the
  rest of the stage, and what was not recorded, and why, is kept in `<run>/tracking.json` for
  the report.
- The `champion` alias is moved only from a version this pipeline registered: an alias someone
  else set is left alone, and the report says so.
- `<run>/tracking.json` is input from whoever can write the storage root, so it is checked
  against MLflow: its run id is used only when that run carries this run key's tag in the
  configured experiment, and a version is reused (and aliased) only when its source and its
  `retrain.sha256` are this package's. Otherwise a new run or version is made, with a warning.
- A fresh SQLite store is created by one process at a time (MLflow's table creation and
  migrations race otherwise, and the loser records nothing).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import queue
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from pydantic import BaseModel, ConfigDict, ValidationError

from training.config import RetrainConfig, TrackingConfig
from training.errors import StorageError
from training.storage.files import read_json, write_json_atomic

__all__ = ["MlflowTracker", "TrackingNotes", "BackgroundTracker", "flat_params", "register_model", "tracker_for"]

log = logging.getLogger(__name__)
TAG_RUN_KEY = "retrain.run_key"
NOTES_FILE = "tracking.json"
MAX_PARAM = 500  # MLflow's param value limit (6000 on recent servers; long lists are cut)


class TrackingNotes(BaseModel):
    """What the stages recorded in MLflow and what they could not (`<run>/tracking.json`)."""

    model_config = ConfigDict(extra="forbid")

    uri: str
    run_id: str | None = None
    experiment_id: str | None = None
    model_version: str | None = None
    aliases: list[str] = []
    recorded: list[str] = []
    problems: list[str] = []


def flat_params(config: RetrainConfig) -> dict[str, str]:
    """The config as MLflow params: dotted keys, JSON values."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = json.dumps(value)[:MAX_PARAM]

    walk("", config.model_dump(mode="json", exclude={"tune", "tracking"}))
    return out


class MlflowTracker:
    """One run key's MLflow run, for one stage. Every call is best effort (see the module)."""

    def __init__(self, config: TrackingConfig, uri: str, run_key: str, run_dir: Path) -> None:
        self.config, self.uri, self.run_key, self.run_dir = config, uri, run_key, run_dir
        self.notes = _read_notes(run_dir / NOTES_FILE, uri)
        self._client: Any = None
        self._checked = False  # the recorded run id was checked against MLflow in this process
        self.off: str | None = None  # why tracking stopped for this stage

    # -- plumbing ---------------------------------------------------------------------------

    def _mlflow(self) -> Any:
        if self._client is None:
            # No retries with back-off (7 by default, minutes against a dead server), a short timeout.
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(max(1, round(self.config.timeout_seconds))))
            from mlflow import MlflowClient

            with _store_creation_lock(self.uri):
                client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
                if self.uri.startswith("sqlite:"):  # both stores made (tables, migrations) under the lock
                    client.search_experiments(max_results=1)
                    client.search_registered_models(max_results=1)
            self._client = client
        return self._client

    def call(self, what: str, fn: Callable[[Any], Any]) -> Any:
        """fn(client), or None when tracking is off or the call fails (recorded, then off)."""
        if self.off is not None:
            self.note_problem(f"{what}: not recorded ({self.off})")
            return None
        try:
            result = fn(self._mlflow())
        except ImportError:
            self.off = "mlflow is not installed: pip install '.[mlflow]'"
            self.note_problem(f"{what}: not recorded ({self.off})")
            return None
        except Exception as err:  # noqa: BLE001 - any MLflow or network failure is the same: not recorded
            reason = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
            self.off = f"MLflow at {self.uri} failed: {reason}"
            self.note_problem(f"{what}: not recorded ({reason})")
            log.warning("MLflow: %s not recorded (%s); the run goes on without tracking this stage", what, reason)
            return None
        if what not in self.notes.recorded:
            self.notes.recorded.append(what)
        return result

    def do(self, what: str, fn: Callable[[Any], Any]) -> bool:
        """fn(client) for its effect: whether it happened."""
        self.call(what, fn)
        return self.off is None

    def note_problem(self, problem: str) -> None:
        if problem not in self.notes.problems:
            self.notes.problems.append(problem)

    def save(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.run_dir / NOTES_FILE, self.notes.model_dump())

    # -- the run ----------------------------------------------------------------------------

    def run_id(self, params: dict[str, str] | None = None, tags: dict[str, str] | None = None) -> str | None:
        """The run key's MLflow run: the one tracking.json names when MLflow confirms it, else
        found by its tag, or created (with `params`)."""
        if self.notes.run_id is not None and (self._checked or self.off is not None):
            return self.notes.run_id

        def find_or_create(client: Any) -> str:
            experiment = client.get_experiment_by_name(self.config.experiment)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else client.create_experiment(self.config.experiment))
            self.notes.experiment_id = experiment_id
            if self.notes.run_id is not None and self._is_ours(client, self.notes.run_id, experiment_id):
                return self.notes.run_id
            found = client.search_runs([experiment_id], filter_string=f"tags.`{TAG_RUN_KEY}` = '{self.run_key}'",
                                       max_results=1)
            if found:
                return str(found[0].info.run_id)
            run = client.create_run(experiment_id, run_name=self.run_key, tags={TAG_RUN_KEY: self.run_key, **(tags or {})})
            if params:
                from mlflow.entities import Param

                items = [Param(k, v) for k, v in params.items()]
                for i in range(0, len(items), 100):  # MLflow takes at most 100 params a request
                    client.log_batch(run.info.run_id, params=items[i:i + 100])
            return str(run.info.run_id)

        found = self.call("the MLflow run", find_or_create)
        if found is not None:  # a failed call keeps the record: MLflow may only be down
            self.notes.run_id, self._checked = found, True
        return found

    def _is_ours(self, client: Any, run_id: str, experiment_id: str) -> bool:
        """Whether the recorded run is this run key's, in the configured experiment, and live."""
        from mlflow.exceptions import MlflowException

        try:
            run = client.get_run(run_id)
        except MlflowException:
            run = None
        if (run is not None and run.info.experiment_id == experiment_id and run.info.lifecycle_stage == "active"
                and run.data.tags.get(TAG_RUN_KEY) == self.run_key):
            return True
        problem = (f"{NOTES_FILE} named MLflow run {run_id!r}, which is not run key {self.run_key}'s run in "
                   f"experiment '{self.config.experiment}': not used; this run key's own run is used instead")
        log.warning("MLflow: %s", problem)
        self.note_problem(problem)
        return False

    def log_metrics(self, metrics: dict[str, float], step: int, what: str) -> None:
        run_id = self.run_id()
        if run_id is None:
            return

        def log(client: Any) -> None:
            import time

            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            client.log_batch(run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

        self.call(what, log)

    def logged_steps(self, key: str) -> set[int]:
        """Steps `key` was logged at already (a resumed run replays validations after its checkpoint)."""
        run_id = self.run_id()
        if run_id is None:
            return set()
        history = self.call("the metric history", lambda client: client.get_metric_history(run_id, key))
        return {int(m.step) for m in history or []}


def register_model(tracker: MlflowTracker, package_dir: Path, sha256: str, is_champion: bool) -> None:
    """The package as a version of `tracking.registered_model` (once per run, a retry finds it),
    `challenger` on it, and `champion` when the pipeline's champion pointer names it (moved
    there by this run, or there already)."""
    run_id = tracker.run_id()
    if run_id is None:
        tracker.note_problem(f"the registered model version: not recorded ({tracker.off or 'no MLflow run'})")
        tracker.save()
        return
    name = tracker.config.registered_model

    def version_of_run(client: Any) -> str:
        source = f"{client.get_run(run_id).info.artifact_uri}/model"
        existing = client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
        for found in existing:
            tags = dict(found.tags or {})
            if (found.source == source and tags.get("retrain.sha256") == sha256
                    and tags.get(TAG_RUN_KEY) == tracker.run_key):
                return str(found.version)
        if existing:
            problem = (f"version {existing[0].version} of '{name}' from this run has another source or sha256 than "
                       "this package: not aliased; a new version is registered")
            log.warning("MLflow: %s", problem)
            tracker.note_problem(problem)
        client.log_artifacts(run_id, str(package_dir), artifact_path="model")  # weights, model.json, export/
        from mlflow.exceptions import MlflowException

        try:
            client.get_registered_model(name)
        except MlflowException as err:
            if err.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            client.create_registered_model(name, description="Models trained and promoted by the retrain pipeline.")
        version = client.create_model_version(name, source, run_id=run_id,
                                              tags={TAG_RUN_KEY: tracker.run_key, "retrain.sha256": sha256})
        return str(version.version)

    version = tracker.call("the registered model version", version_of_run)
    if version is None:
        tracker.save()
        return
    tracker.notes.model_version = version
    if tracker.do("the challenger alias", lambda c: c.set_registered_model_alias(name, "challenger", version)):
        _add_alias(tracker, "challenger")
    if is_champion:
        _move_champion(tracker, name, version)
    tracker.save()


def _add_alias(tracker: MlflowTracker, alias: str) -> None:
    if alias not in tracker.notes.aliases:
        tracker.notes.aliases.append(alias)


def _move_champion(tracker: MlflowTracker, name: str, version: str) -> None:
    """Move `champion` to `version`, unless someone else's version holds it (never silently)."""
    def holder(client: Any) -> tuple[str, dict[str, str]] | None:
        from mlflow.exceptions import MlflowException

        try:
            current = client.get_model_version_by_alias(name, "champion")
        except MlflowException as err:
            if err.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                return None  # no champion alias yet
            raise
        return str(current.version), dict(current.tags or {})

    found = tracker.call("the champion alias's holder", holder)
    if tracker.off is not None:
        return
    if found is not None and found[0] != version and TAG_RUN_KEY not in found[1]:
        tracker.note_problem(f"the champion alias: not moved: it is on version {found[0]} of '{name}', which this "
                              "pipeline did not register (move it by hand if this model should replace it)")
        return
    if tracker.do("the champion alias", lambda c: c.set_registered_model_alias(name, "champion", version)):
        _add_alias(tracker, "champion")


def _read_notes(path: Path, uri: str) -> TrackingNotes:
    """tracking.json as written by these stages, or fresh notes when it is absent, unreadable,
    holds keys it never holds, or was written for another MLflow server."""
    try:
        found = read_json(path)
    except StorageError as err:
        log.warning("%s; its MLflow records are found again by the run key", err)
        return TrackingNotes(uri=uri)
    if found is None:
        return TrackingNotes(uri=uri)
    try:
        notes = TrackingNotes.model_validate(found)
    except ValidationError as err:
        first = err.errors()[0]
        log.warning("%s: %s at %s; its MLflow records are found again by the run key", path, first["msg"],
                    ".".join(str(p) for p in first["loc"]) or "the top")
        return TrackingNotes(uri=uri)
    return notes if notes.uri == uri else TrackingNotes(uri=uri)


@contextmanager
def _store_creation_lock(uri: str) -> Iterator[None]:
    """One process at a time creates a SQLite store's tables (a lock file beside the database)."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    database = Path(uri.removeprefix("sqlite:///").split("?", 1)[0])
    database.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{database}.retrain-create.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
        yield


def tracker_for(config: RetrainConfig, run_key: str, run_dir: Path) -> MlflowTracker | None:
    uri = config.tracking.uri()
    return None if uri is None else MlflowTracker(config.tracking, uri, run_key, run_dir)


class BackgroundTracker:
    """Validation metrics sent from one thread of their own, so a slow MLflow never holds up
    the training process's output (and so the training). `close` waits `timeout` at most."""

    def __init__(self, tracker: MlflowTracker, params: dict[str, str], metric_key: str) -> None:
        self.tracker = tracker
        self._queue: queue.Queue[tuple[dict[str, float], int] | None] = queue.Queue()
        self._params, self._metric_key = params, metric_key
        self._thread = threading.Thread(target=self._run, name="mlflow-metrics", daemon=True)
        self._thread.start()

    def submit(self, metrics: dict[str, float], step: int) -> None:
        self._queue.put((metrics, step))

    def _run(self) -> None:
        self.tracker.run_id(self._params)  # found or created here too: never on the caller's time
        logged = self.tracker.logged_steps(self._metric_key)
        while (item := self._queue.get()) is not None:
            metrics, step = item
            if step not in logged:
                self.tracker.log_metrics(metrics, step, "validation metrics")

    def close(self, timeout: float) -> None:
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.tracker.note_problem(f"validation metrics: not all recorded (MLflow slower than {timeout:.0f} s)")
        self.tracker.save()
