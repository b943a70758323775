"""Batch scoring: Parquet in, Parquet out, with a verified model package.

Rows are read, validated and encoded by packing's own code (`feature_arrays`) and transformed by
the package's own `FeatureStats`, so nulls, unseen categories, texts and images are handled
exactly as in training and evaluation. The model sees batches of `SCORE_BATCH` rows, the
evaluation batch: scoring the test split gives the very numbers evaluation scored.

Reading and encoding run on one thread, the model on the caller's, and writing on a third, so
the three overlap; at most a few chunks are in memory, whatever the input's size.

The output holds the chosen key columns (default: every input column) and the prediction
columns of the task, with the model's hashes and the input's fingerprint in the Parquet
metadata. It is written under a temporary name and renamed; a rerun whose output already holds
the same model, input and columns does nothing.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import torch

from training.config import DataConfig
from training.data.batch import Columns
from training.data.ingest.arrow_buffers import arrow_float32, arrow_float64, arrow_int8, arrow_int64
from training.data.ingest.validation import FeatureValidator, feature_arrays
from training.data.prepare.features import FeatureStats, FeatureTransform
from training.errors import CheckpointError, ConfigError, DataError, StorageError
from training.model.evaluation import EVAL_BATCH
from training.model.network import forward_fn
from training.model.objectives import Task
from training.model.package import load_package, meta_sha256
from training.model.predict_result import PredictResult
from training.storage.files import sha256_file

__all__ = ["PREDICTION_COLUMNS", "SCORE_BATCH", "ScoringModel", "input_fingerprint", "load_scoring_model",
           "predict_files", "prediction_columns", "scoring_meta"]

SCORE_BATCH = EVAL_BATCH
READ_ROWS = 8 * SCORE_BATCH  # read and encoded at once: fewer calls; a multiple of the batch
FORMAT = "1"
PREDICTION_COLUMNS = {"binary": ["probability", "prediction"], "multiclass": ["prediction", "probabilities"],
                      "regression": ["prediction"]}
# The output's Parquet key-value metadata: what a rerun compares to skip scoring again.
PREFIX = "retrain."


@dataclass(frozen=True)
class ScoringModel:
    """A loaded, verified package: what scoring needs of it."""

    model: torch.nn.Module
    stats: FeatureStats
    sha256: str  # the weights'
    meta_sha256: str  # model.json's, which covers every file of the package

    @functools.cached_property
    def validator(self) -> FeatureValidator:
        """Packing's validation and encoding, for the package's feature columns (once per model)."""
        s = self.stats
        return FeatureValidator(DataConfig(task=s.task, label=s.label or "__label__", numeric=s.numeric,
                                           categorical=s.categorical, vector=s.vector, text=s.text, image=s.image))

    @property
    def columns(self) -> list[str]:
        s = self.stats
        return [*self.validator.config.numeric_columns, *s.categorical, *s.vector, *s.text, *s.image]


def load_scoring_model(package_dir: Path, trusted_factory: str | None, expected_meta_sha256: str | None = None,
                       expected_sha256: str | None = None) -> ScoringModel:
    """The package's model, verified: model.json against `expected_meta_sha256` (the champion
    pointer's), the weights against model.json and against `expected_sha256` (a models/<sha>
    folder's name). A mismatch is a CheckpointError naming the file."""
    model, stats, meta = load_package(package_dir, trusted_factory, expected_meta_sha256)
    if expected_sha256 is not None and meta.sha256 != expected_sha256:
        raise CheckpointError(f"model package {package_dir}: its weights' sha256 {meta.sha256[:12]} is not "
                              f"{expected_sha256[:12]}, the model asked for (replaced or tampered with)")
    return ScoringModel(model, stats, meta.sha256, meta_sha256(package_dir))


def prediction_columns(task: str) -> list[str]:
    return PREDICTION_COLUMNS[task]


def input_fingerprint(files: list[Path]) -> str:
    """The input's content: every file's name, size and sha256, in order."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{f.stat().st_size}\0{sha256_file(f)}\n".encode())
    return h.hexdigest()


def _chunks(path: Path, columns: list[str], rows: int) -> Iterator[pa.Table]:
    """The file's rows in tables of exactly `rows` rows (the last one shorter): Parquet's own
    batches stop at row-group ends, and scoring must batch as evaluation does."""
    try:
        pending: list[pa.RecordBatch] = []
        have = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=rows, columns=columns):
            pending.append(batch)
            have += batch.num_rows
            while have >= rows:
                table = pa.Table.from_batches(pending)
                yield table.slice(0, rows)
                rest = table.slice(rows)
                pending, have = rest.to_batches(), rest.num_rows
        if have:
            yield pa.Table.from_batches(pending)
    except (pa.ArrowInvalid, OSError) as err:
        raise DataError(f"{path}: not a readable Parquet file (truncated or corrupt?): {err}") from None


def _check_columns(path: Path, schema: pa.Schema, scoring: ScoringModel, keys: list[str]) -> None:
    scoring.validator.check_schema(path, schema, with_label=False)
    missing = [k for k in keys if k not in schema.names]
    if missing:
        raise DataError(f"{path}: key column(s) {missing} not in the input; present: {schema.names}")
    clash = [c for c in prediction_columns(scoring.stats.task) if c in keys]
    if clash:
        raise DataError(f"{path}: input column(s) {clash} would be overwritten by the prediction; "
                        "leave them out of the key columns (--keys)")


def _predictions(task: Task, stats: FeatureStats, output: torch.Tensor) -> dict[str, pa.Array]:
    # Through the arrays' buffers: pa.array() would import pandas, a tenth of a scoring command's time.
    pred = task.predict(output)
    if stats.task == "binary":
        return {"probability": arrow_float32(pred), "prediction": arrow_int8(pred >= 0.5)}
    if stats.task == "multiclass":
        classes = pa.array(stats.classes)
        probs = pa.FixedSizeListArray.from_arrays(arrow_float32(pred.reshape(-1)), len(stats.classes))
        return {"prediction": classes.take(arrow_int64(pred.argmax(axis=1))), "probabilities": probs}
    return {"prediction": arrow_float64(pred)}


@dataclass(frozen=True)
class _Chunk:
    path: Path
    table: pa.Table  # the rows as read: the key columns come from here
    ready: Columns  # the model's inputs, transformed


def _prepare(scoring: ScoringModel, transform: FeatureTransform, path: Path, table: pa.Table, first: int) -> _Chunk:
    """Validate, encode and transform one chunk exactly as packing and preprocessing do."""
    batch = table.combine_chunks().to_batches()[0]
    encoded = feature_arrays(scoring.validator, path, batch, first, scoring.stats.vector_dims, first)
    return _Chunk(path, table, transform.shard([encoded], ""))


def _prepared(scoring: ScoringModel, files: list[Path], keys: list[str]) -> Iterator[_Chunk]:
    transform = scoring.stats.transformer()
    needed = list(dict.fromkeys([*keys, *scoring.columns]))
    for path in files:
        _check_columns(path, _schema(path), scoring, keys)
        first = 0
        for table in _chunks(path, needed, READ_ROWS):
            yield _prepare(scoring, transform, path, table, first)
            first += table.num_rows


def _ahead(items: Iterator[_Chunk], depth: int = 2) -> Iterator[_Chunk]:
    """`items` produced on a thread, `depth` ahead of the consumer (Arrow and numpy release the
    GIL: reading and encoding the next chunk overlaps the model on this one)."""
    done = object()
    q: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                if stop.is_set():
                    return
                q.put(item)
            q.put(done)
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, raised there
            q.put(err)

    thread = threading.Thread(target=produce, name="predict-read", daemon=True)
    thread.start()
    try:
        while (item := q.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            with contextlib.suppress(queue.Empty):
                q.get(timeout=0.1)


# Inference mode, not no_grad: scoring never trains, and skipping the autograd bookkeeping
# (version counters, view tracking) was measured at 6 % of a forward on one thread.
@torch.inference_mode()
def _score(scoring: ScoringModel, task: Task, chunk: _Chunk, keys: list[str]) -> pa.Table:
    forward, n = forward_fn(scoring.model), chunk.table.num_rows
    # The model sees batches of SCORE_BATCH rows from the start of the file, as evaluation does
    # from the start of the split (a row's result may depend on its batch's shape).
    output = torch.cat([forward(chunk.ready.slice(lo, lo + SCORE_BATCH).map(torch.from_numpy))
                        for lo in range(0, n, SCORE_BATCH)])
    table = chunk.table.select(keys)  # the key columns as read: no copy
    for name, values in _predictions(task, scoring.stats, output).items():
        table = table.append_column(name, values)
    return table


def _already_done(output: Path, meta: dict[bytes, bytes]) -> bool:
    try:
        found = pq.read_schema(output).metadata or {}
    except (OSError, pa.ArrowInvalid):
        return False
    return all(found.get(k) == v for k, v in meta.items())


def scoring_meta(files: list[Path], scoring: ScoringModel, keys: list[str] | None) -> tuple[list[str], dict[bytes, bytes]]:
    """The key columns (default: every column of the first file) and what the output records of
    its model and input: equal for a rerun that would write the same scores."""
    if not files:
        raise DataError("no input Parquet files to score")
    keys = list(_schema(files[0]).names) if keys is None else keys
    recorded = {"model_sha256": scoring.sha256, "model_meta_sha256": scoring.meta_sha256,
                "input": input_fingerprint(files), "keys": json.dumps(keys), "format": FORMAT,
                "classes": json.dumps(scoring.stats.classes)}
    return keys, {(PREFIX + name).encode(): value.encode() for name, value in recorded.items()}


def predict_files(files: list[Path], scoring: ScoringModel, output: Path, keys: list[str] | None = None
                  ) -> PredictResult:
    """Score `files` into `output`: Parquet, or CSV/TSV for a .csv/.tsv name (see the module
    docstring and `_CsvWriter`)."""
    t0 = time.perf_counter()
    _check_output(output, files)
    keys, meta = scoring_meta(files, scoring, keys)
    if output.exists() and _already_done(output, meta):
        rows = pq.ParquetFile(output).metadata.num_rows
        return PredictResult(output=str(output), rows=rows, model_sha256=scoring.sha256, skipped=True,
                             seconds=time.perf_counter() - t0, key_columns=keys)
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        rows = _write(files, scoring, tmp, keys, meta, output)
        os.replace(tmp, output)
    except OSError as err:  # the inputs' read errors are DataErrors by now: this is the output's
        raise StorageError(f"cannot write the scores to {output}: {_write_failure(err, output)}") from None
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # it was never made: the folder could not be written
    return PredictResult(output=str(output), rows=rows, model_sha256=scoring.sha256, skipped=False,
                         seconds=time.perf_counter() - t0, key_columns=keys)


def _write_failure(err: OSError, output: Path) -> str:
    if isinstance(err, (FileExistsError, NotADirectoryError)):
        return f"{output.parent} is not a folder; choose another --output"
    text = err.strerror or str(err).splitlines()[0]
    if err.errno == errno.ENOSPC or "No space left on device" in text:
        return "No space left on device; free space there or choose another --output"
    return f"{text}; choose another --output"


def _check_output(output: Path, files: list[Path]) -> None:
    """The output must be a file that is not one of the inputs: scores never replace the data
    they were computed from, and a folder is not replaced by a file."""
    if output.is_dir():
        raise ConfigError(f"--output {output} is a folder; name the file to write, e.g. {output / 'scores.parquet'} "
                          "(or scores.csv)")
    target = output.resolve()
    clash = next((f for f in files if f.resolve() == target), None)
    if clash is not None:
        raise ConfigError(f"--output {output} is the input file {clash}; write the scores to another file")


def _schema(path: Path) -> pa.Schema:
    try:
        return pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise DataError(f"{path}: not a readable Parquet file (truncated or corrupt?): {err}") from None


def _write(files: list[Path], scoring: ScoringModel, tmp: Path, keys: list[str], meta: dict[bytes, bytes],
           output: Path) -> int:
    task = Task.of(scoring.stats)
    scoring.model.eval()
    writer: pq.ParquetWriter | _CsvWriter | None = None
    rows = 0
    # Written on a thread of its own, one batch behind the model (Parquet encoding releases the GIL).
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="predict-write") as pool:
        pending: Future[None] | None = None
        try:
            for chunk in _ahead(_prepared(scoring, files, keys)):
                scored = _score(scoring, task, chunk, keys)
                if writer is None:
                    writer = _writer(tmp, scored.schema.with_metadata(meta), output, list(scoring.stats.classes or []))
                if pending is not None:
                    pending.result()
                pending = pool.submit(writer.write_table, scored)
                rows += scored.num_rows
            if pending is not None:
                pending.result()
        finally:
            if writer is not None:
                writer.close()
    if writer is None or rows == 0:
        raise DataError(f"the input ({files[0]}{' and more' if len(files) > 1 else ''}) has no rows to score")
    return rows


CSV_DELIMITERS = {".csv": ",", ".tsv": "\t"}  # an output named so is written as text, with a header


class _CsvWriter:
    """Scores as CSV or TSV. Text has no nested or dictionary columns: a multiclass score's
    probabilities become one column per class (`probability_<class>`, in the model's class
    order), dictionary keys their values. The model and input the scores came from, which a
    Parquet output keeps in its metadata, have no place in CSV, so a rerun scores again."""

    def __init__(self, path: Path, schema: pa.Schema, delimiter: str, classes: list[Any]) -> None:
        self._classes = classes
        self._writer: pa_csv.CSVWriter | None = None
        self._path, self._delimiter = path, delimiter

    def _flat(self, table: pa.Table) -> pa.Table:
        columns, names = [], []
        for name, column in zip(table.column_names, table.columns, strict=True):
            if pa.types.is_fixed_size_list(column.type):
                values = column.combine_chunks().flatten().to_numpy().reshape(-1, len(self._classes))
                for i, cls in enumerate(self._classes):
                    columns.append(pa.array(values[:, i]))
                    names.append(f"probability_{cls}")
                continue
            if pa.types.is_dictionary(column.type):
                column = column.cast(column.type.value_type)
            columns.append(column)
            names.append(name)
        return pa.table(columns, names=names)

    def write_table(self, table: pa.Table) -> None:
        flat = self._flat(table)
        if self._writer is None:
            options = pa_csv.WriteOptions(delimiter=self._delimiter)
            self._writer = pa_csv.CSVWriter(str(self._path), flat.schema, write_options=options)
        self._writer.write_table(flat)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def _writer(path: Path, schema: pa.Schema, output: Path, classes: list[Any]) -> pq.ParquetWriter | _CsvWriter:
    delimiter = CSV_DELIMITERS.get(output.suffix.lower())
    if delimiter is not None:
        return _CsvWriter(path, schema, delimiter, classes)
    # Dictionary encoding only for strings: on float columns it was measured to double the
    # write time (the slowest part of scoring) and to make the file larger.
    strings = [f.name for f in schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)
               or pa.types.is_dictionary(f.type)]
    return pq.ParquetWriter(path, schema, use_dictionary=strings or False)
