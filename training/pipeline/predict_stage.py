"""The predict stage: which model (the champion, a promoted sha, or a package folder), which
input (a Parquet file, a directory, or an s3:// prefix) and where the scores go (a local path
or an s3:// key). The scoring itself is `training.model.batch_scoring`.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator

from training.config import RetrainConfig
from training.data.ingest.csv_files import CONVERSIONS, is_csv
from training.data.ingest.sources import LocalSource, is_source_file, source_files
from training.errors import CheckpointError, ConfigError, DataError
from training.model.batch_scoring import ScoringModel, load_scoring_model, predict_files, scoring_meta
from training.model.predict_result import PredictResult
from training.protocol.threads import decide_threads
from training.registry.champion import check_champion
from training.storage.root import StorageRoot, settings_for
from training.storage.s3 import S3Store, parse_s3_uri
from training.copies import updated

__all__ = ["nothing_to_score", "predict_stage", "resolve_model", "scoring_threads"]

_SHA = re.compile(r"[0-9a-f]{64}")


def resolve_model(config: RetrainConfig, model: str) -> ScoringModel:
    """`champion`, a promoted model's sha256 (`models/<sha>/` under the storage root) or a
    package folder, loaded and verified."""
    trusted = config.model.factory
    if model == "champion":
        root = StorageRoot.from_config(config)
        champion = check_champion(root, trusted)
        if champion is None:
            raise CheckpointError(f"no champion yet at {root.display('models/champion')}: run `retrain run` until "
                                  "a model is promoted, or pass --model with a model sha256 or package folder")
        if not champion.usable:
            raise CheckpointError(f"the champion {champion.sha256[:12]} cannot be used: {champion.problem}")
        return load_scoring_model(champion.package, trusted, champion.meta_sha256, champion.sha256)
    if _SHA.fullmatch(model):
        root = StorageRoot.from_config(config)
        for name in ("model.json", "model.pt"):
            if root.fetch(f"models/{model}/{name}") is None:
                raise CheckpointError(f"no promoted model {model[:12]} at {root.display(f'models/{model}')}")
        return load_scoring_model(root.path(f"models/{model}"), trusted, expected_sha256=model)
    package = Path(model).expanduser()
    if not (package / "model.json").is_file():
        raise CheckpointError(f"--model {model}: neither 'champion', a 64-hex model sha256, nor a package folder "
                              "holding model.json")
    return load_scoring_model(package, trusted)


def _s3_store(config: RetrainConfig, uri: str) -> S3Store:
    bucket, prefix = parse_s3_uri(uri)
    base = settings_for(updated(config.storage, {"root": f"s3://{bucket}"}))
    return S3Store(type(base)(**{**base.to_json(), "prefix": prefix}))


def _download_inputs(config: RetrainConfig, uri: str, into: Path) -> list[Path]:
    """Every Parquet and CSV object under an s3:// prefix, downloaded in name order (verified sizes)."""
    store = _s3_store(config, uri)
    listed = {rel: size for rel, size in store.list("").items() if is_source_file(rel)}
    if not listed:
        raise DataError(f"{uri}: no Parquet or CSV objects under this prefix")
    files = []
    for i, rel in enumerate(sorted(listed)):
        # Numbered so name order stays the input order; the object's name is kept for messages.
        files.append(store.download_file(rel, into / f"{i:06d}-{Path(rel).name}", size=listed[rel]))
    return files


# What names the input to score: the CLI's option, or the predict flow's (and deployment's) parameter.
INPUT_SETTING = "--input (the predict flow's `input` parameter)"


@contextlib.contextmanager
def scoring_threads(config: RetrainConfig) -> Iterator[int]:
    """torch's intra-op threads while scoring, by training's policy (`train.loader.torch_threads`:
    N as given; `auto` keeps one core of the CPUs this process may use for the reading and
    writing threads that run beside the model), restored afterwards."""
    import torch

    before = torch.get_num_threads()
    threads = decide_threads(config.train.loader.torch_threads, loader_workers=0).threads
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)


def nothing_to_score(source: str) -> str | None:
    """Why a local input holds nothing to score yet (None: it holds Parquet files, or it is on
    S3, where listing it is the stage's work). A deployment triggered after every retrain meets
    an input folder before its first file lands: that is a skip, not a failure. An input that
    does not exist at all is a mistake in the run's parameters: a DataError, so the run fails."""
    if source.startswith("s3://"):
        return None
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(f"the input {path} does not exist (--input / the predict deployment's `input`); name a "
                        "Parquet or CSV file or a folder of them")
    if path.is_dir() and not any(p.is_file() and is_source_file(p.name) for p in path.rglob("*")):
        return f"the input folder {path} holds no .parquet or .csv file yet"
    return None


def predict_stage(config: RetrainConfig, source: str, output: str, model: str = "champion",
                  keys: list[str] | None = None) -> PredictResult:
    """Score `source` with `model` into `output` (see `training.model.batch_scoring`)."""
    _check_output_outside_input(source, output)
    nothing_to_score(source)  # a missing local input: one line before the model is fetched and loaded
    scoring = resolve_model(config, model)
    with scoring_threads(config) as threads, tempfile.TemporaryDirectory(prefix="retrain-predict-") as tmp:
        listed = (_download_inputs(config, source, Path(tmp) / "in") if source.startswith("s3://")
                  else source_files(Path(source).expanduser(), INPUT_SETTING))
        converted = {_as_parquet(f): f for f in listed}  # CSV read as training reads it
        files = list(converted)
        try:
            if not output.startswith("s3://"):
                result = predict_files(files, scoring, Path(output).expanduser(), keys)
            else:
                result = _predict_to_s3(config, files, scoring, output, keys, Path(tmp) / "out")
        except DataError as err:  # name the user's file, not its conversion
            text = str(err)
            for parquet, original in converted.items():
                text = text.replace(str(parquet), str(original))
            raise DataError(text) from None
        return updated(result, {"torch_threads": threads})


def _as_parquet(path: Path) -> Path:
    """A CSV input's Parquet conversion (training.data.ingest.csv_files: the bytes training packs); a
    Parquet file itself."""
    if not is_csv(path.name):
        return path
    source = LocalSource(path, INPUT_SETTING)
    (file,) = source.files()
    source.as_parquet(file)
    return CONVERSIONS.path(source.uri, file.name)


def _check_output_outside_input(source: str, output: str) -> None:
    """Scores written into the input folder would be read as input by the next run."""
    if source.startswith("s3://") or output.startswith("s3://"):
        return
    folder, target = Path(source).expanduser().resolve(), Path(output).expanduser().resolve()
    if folder.is_dir() and target.is_relative_to(folder):
        raise ConfigError(f"--output {output} is inside the input folder {source}: the next run would read the "
                          "scores as input; write them outside it")


def _predict_to_s3(config: RetrainConfig, files: list[Path], scoring: ScoringModel, output: str,
                   keys: list[str] | None, scratch: Path) -> PredictResult:
    """Scored locally, then one PUT (S3 shows the whole object or none of it), tagged with what
    it holds: a rerun that finds the same tags does nothing."""
    t0 = time.perf_counter()
    bucket_uri, key = output.rsplit("/", 1)
    store = _s3_store(config, bucket_uri)
    keys, meta = scoring_meta(files, scoring, keys)
    # S3 tag values hold 256 characters: each piece of the Parquet metadata as its sha256.
    tags = {k.decode().replace("retrain.", "retrain-"): hashlib.sha256(v).hexdigest() for k, v in meta.items()}
    found = store.tags_of(key) if store.head(key) is not None else {}
    if found and all(found.get(k) == v for k, v in tags.items()):
        return PredictResult(output=output, rows=int(found.get("retrain-rows", 0)), model_sha256=scoring.sha256,
                             skipped=True, seconds=time.perf_counter() - t0, key_columns=keys)
    result = predict_files(files, scoring, scratch / Path(key).name, keys)
    store.upload_file(key, Path(result.output), tags={**tags, "retrain-rows": str(result.rows)})
    shutil.rmtree(scratch, ignore_errors=True)
    return updated(result, {"output": output})
