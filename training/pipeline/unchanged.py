"""Is a `retrain run` already done? The rerun that would change nothing, found before the
pipeline, Prefect or a server is loaded.

The report stage records, under `runs/unchanged/<key>.json`, what a finished run's outcome
depended on; `<key>` is the fingerprint of the whole effective config, the code and the
libraries that compute. The record adds the source files' dataset fingerprint and the champion
the run left in place. `retrain run` computes the key, and when a record exists, its report is
still there, the source's bytes give the same dataset and the champion pointer names the same
model, the flow would find every stage done and decide the promotion the same way: the CLI prints
that report instead of running it (`--force` runs it anyway).

Not recorded, so always rerun through the flow:
- a run that promoted its model with `train.init_from: champion` (a rerun would warm-start
  from the new champion, which is another run);
- a run that judged an unusable champion (it may have been repaired since);
- a run whose MLflow tracking left something unrecorded (a rerun records it).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from training.config import RetrainConfig, fingerprint
from training.data.ingest.source_index import INDEX_FILE, SourceIndex, known_fingerprints
from training.data.ingest.sources import open_source
from training.errors import RetrainError
from training.model.model_ref import read_pointer
from training.pipeline.reports.run_report import RunReport
from training.storage.files import read_json, write_json_atomic
from training.storage.root import RUN, StorageRoot

__all__ = ["UnchangedRun", "find_unchanged", "record_unchanged", "unchanged_key"]

log = logging.getLogger(__name__)

INDEX = "runs/unchanged"
_PACKAGES = ("training", "tasks", "flows")  # the code a run's outcome depends on
# The libraries whose versions change what a run computes or how it reads its files.
_LIBRARIES = ("torch", "numpy", "pyarrow", "tokenizers", "pillow", "prefect")


class UnchangedRecord(BaseModel):
    """runs/unchanged/<key>.json: what a finished run's outcome depended on."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    run_key: str
    dataset: str  # the source's dataset fingerprint
    source: str
    champion_sha256: str | None  # the champion as the run's promotion decision left it
    report: str  # the run's report.json, relative to the root


@dataclass(frozen=True)
class UnchangedRun:
    run_key: str
    report: Path
    content: RunReport  # the report, read once here


@lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """sha256 over the pipeline's source files and the versions of the libraries it computes
    with: a changed checkout or upgraded library is a changed run."""
    digest = hashlib.sha256()
    base = Path(__file__).resolve().parent.parent
    for package in _PACKAGES:
        for path in sorted((base / package).rglob("*.py")):
            digest.update(f"{path.relative_to(base)}\0".encode())
            digest.update(path.read_bytes())
    for name in _LIBRARIES:
        try:
            digest.update(f"{name}=={metadata.version(name)}\0".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{name} absent\0".encode())
    return digest.hexdigest()


def unchanged_key(config: RetrainConfig) -> str:
    return fingerprint("unchanged", config.model_dump(mode="json"), code_fingerprint())


def _rel(config: RetrainConfig) -> str:
    return f"{INDEX}/{unchanged_key(config)}.json"


def record_unchanged(config: RetrainConfig, root: StorageRoot, run_key: str, dataset: str, source: str,
                     champion_after: str | None, report_rel: str) -> None:
    """Record a finished run for `find_unchanged`; `champion_after` is the champion's sha256 as
    the run's promotion decision left it (None: no champion)."""
    rel = _rel(config)
    record = UnchangedRecord(run_key=run_key, dataset=dataset, source=source, champion_sha256=champion_after,
                             report=report_rel)
    write_json_atomic(root.path(rel), record.model_dump(mode="json"))
    root.publish(rel, RUN, run_key)


def find_unchanged(config: RetrainConfig) -> UnchangedRun | None:
    """The finished run this config would only repeat, or None (run the flow). Anything that
    cannot be read or checked here is None: the flow decides, with its own errors."""
    try:
        return _find(config)
    except (RetrainError, OSError, ValueError, ValidationError) as err:
        log.debug("no unchanged-run shortcut: %s", err)
        return None


def _find(config: RetrainConfig) -> UnchangedRun | None:
    root = StorageRoot.from_config(config)
    path = root.fetch(_rel(config))
    raw = read_json(path) if path is not None else None
    if raw is None:
        return None
    record = UnchangedRecord.model_validate(raw)
    report = root.fetch(record.report)
    if report is None:
        return None
    content = RunReport.read(report)
    if content.run_key != record.run_key:
        return None
    source = open_source(record.source, config.storage)
    rel = f"datasets/{INDEX_FILE}"
    index = SourceIndex(root.fetch(rel, fresh=True) or root.path(rel))
    if record.dataset not in known_fingerprints(index, config.data, source.uri, source.files()):
        return None  # a file is new or changed (its bytes are not read here): a new dataset
    if _champion_sha(root) != record.champion_sha256:
        return None  # promoted or replaced since: the promotion decision would differ
    return UnchangedRun(run_key=record.run_key, report=report, content=content)


def _champion_sha(root: StorageRoot) -> str | None:
    """The champion pointer's sha256, when it and its model.json are intact; else "?"."""
    found, _ = root.fetch_versioned("models/champion")
    pointer = read_pointer(found) if found is not None else None
    if pointer is None:
        return None
    meta = root.fetch(f"models/{pointer.sha256}/model.json")
    if meta is None or hashlib.sha256(meta.read_bytes()).hexdigest() != pointer.meta_sha256:
        return "?"  # damaged: the flow's check reports it and judges without it
    return pointer.sha256
