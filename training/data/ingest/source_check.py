"""A user's source, checked before anything else starts (a Prefect server, a flow run): it
exists, its first file is Parquet or CSV, and it has the label and feature columns. One line that
says how to fix it, in a second; and, when the config names no feature column and the
defaults (the demo's columns) are not in the file, the columns inferred from the schema."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field

import pyarrow as pa

from training.config import DataConfig, RetrainConfig, StorageConfig, date_part
from training.data.ingest.demo import DEMOS
from training.data.ingest.label_check import (
    SAMPLED_FILES,
    LabelProfile,
    check_label,
    infer_task,
    merge_profiles,
    positive_class,
    profile_label,
)
from training.data.ingest.number_columns import check_number_columns, looks_numeric
from training.data.ingest.parquet_reader import ParquetRanges
from training.data.ingest.sources import open_source
from training.data.ingest.validation import FeatureValidator
from training.errors import DataError

__all__ = ["InferredColumns", "check_source_columns", "checked_source", "infer_columns", "source_schema"]

LONG_TEXT_CHARS = 40  # strings longer than this on average are free text, not categories
FEATURE_KEYS = ("numeric", "dates", "categorical", "vector", "text", "image")


def checked_source(config: RetrainConfig) -> tuple[RetrainConfig, InferredColumns | None]:
    """The config with its feature columns inferred from the source's schema when none of
    data.numeric/categorical/vector/text/image was given, its task from the label's values when
    data.task was not given, and the source checked against it (a demo source is the project's
    own: nothing to check). Reads a listing, one footer, and the label column of a few files
    spread over the source (`training.data.ingest.label_check`)."""
    spec = config.data.source
    if spec is None:
        return config, None
    if spec in DEMOS:
        # The project's own file: nothing to check, but a demo named with its own columns
        # (`data.text=[review]`) does not inherit the tabular demo's other lists either.
        return _unset_features_not_given(config), None
    ranges = source_schema(spec, config.storage)
    _check_named(ranges.where, ranges.schema, config.data.label, "data.label")
    task_given = "task" in config.data.model_fields_set  # before any key is set below: that sets them all
    config, inferred, candidates = _feature_columns(config, ranges)
    config, inferred = _label_task(config, ranges, inferred, task_given, _source_label(spec, config, ranges))
    check_source_columns(ranges.where, ranges.schema, config.data)
    FeatureValidator(config.data).check_schema(ranges.where, ranges.schema)  # repeated columns, types
    declared = [c for c in config.data.numeric if date_part(c) is None and _is_text(ranges.schema.field(c).type)]
    check_number_columns(ranges, declared, candidates)
    return config, inferred


def _unset_features_not_given(config: RetrainConfig) -> RetrainConfig:
    """Where the config names some feature lists, the others are empty (not the demo's)."""
    given = config.data.model_fields_set & set(FEATURE_KEYS)
    unset: dict[str, list[str]] = {f"data.{k}": [] for k in FEATURE_KEYS if k not in given}
    return config.with_values(unset, "(feature lists the config does not give)") if given and unset else config


def _feature_columns(config: RetrainConfig, ranges: ParquetRanges
                     ) -> tuple[RetrainConfig, InferredColumns | None, list[str]]:
    """Inferred where the config names no feature column and the defaults (the demo's columns)
    are not all there: a demo-shaped file keeps training as it always did, less its label. Where
    the config names some, the others are empty: a user's source never inherits the demo's lists.
    Also the inferred text columns whose first rows are all numbers (checked whole later)."""
    label = config.data.label
    if config.data.model_fields_set & set(FEATURE_KEYS):
        return _unset_features_not_given(config), None, []
    defaults = [c for k in FEATURE_KEYS for c in getattr(config.data, k)]
    if set(defaults) <= set(ranges.schema.names):
        kept = {f"data.{k}": [c for c in getattr(config.data, k) if c != label] for k in FEATURE_KEYS}
        return config.with_values(kept, "(the demo's feature columns, less the label)"), None, []
    sample = _strings_sample(ranges)
    exclude = tuple(c for c in (config.data.split_key, config.data.time_column) if c)
    inferred = infer_columns(ranges.schema, label, sample, exclude)
    config = config.with_values({f"data.{k}": v for k, v in inferred.columns.items()},
                                f"(feature columns inferred from {ranges.where})")
    candidates = [c for c in inferred.columns.get("categorical", [])
                  if sample is not None and c in sample.column_names and looks_numeric(sample.column(c))]
    return config, inferred, candidates


def _source_label(spec: str, config: RetrainConfig, first: ParquetRanges) -> LabelProfile:
    """The label's profile over the source: its first file and up to SAMPLED_FILES - 1 more,
    evenly spread over the source's order, the last among them."""
    source = open_source(spec, config.storage)
    files = source.files()
    picks = sorted({round(i * (len(files) - 1) / max(1, SAMPLED_FILES - 1)) for i in range(SAMPLED_FILES)})
    profiles = [profile_label(first, config.data.label)]
    profiles += [profile_label(ParquetRanges(source, files[i]), config.data.label) for i in picks if i > 0]
    return merge_profiles(source.uri, profiles)


def _label_task(config: RetrainConfig, ranges: ParquetRanges, inferred: InferredColumns | None, task_given: bool,
                label: LabelProfile) -> tuple[RetrainConfig, InferredColumns | None]:
    """data.task from the label's values (over the source) when the config does not give it;
    a binary label of two values other than 0/1 gets its positive and negative classes; the
    label checked against the task either way."""
    data = config.data
    if not task_given:
        task, why = infer_task(label)
        config = config.with_values({"data.task": task}, f"(the task inferred from label '{label.name}')")
        inferred = inferred or InferredColumns()
        inferred.task, inferred.task_why = task, why
    if config.data.task == "binary" and _two_values(label) and data.negative is None:
        positive, negative = positive_class(label, data.positive)
        config = config.with_values({"data.positive": positive, "data.negative": negative},
                                    f"(the classes of label '{label.name}')")
        if inferred is not None:
            inferred.positive = positive
    check_label(label, config.data.task, config.data.drop_null_labels, config.data.positive)
    return config, inferred


def _two_values(label: LabelProfile) -> bool:
    """A label whose two values are not already binary's own (booleans, or 0 and 1)."""
    return (not label.many and len(label.distinct) == 2 and not pa.types.is_boolean(label.type)
            and set(label.distinct) != {0, 1})


def _is_text(t: pa.DataType) -> bool:
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t))


def source_schema(spec: str, storage: StorageConfig | None = None) -> ParquetRanges:
    """The source's first file, opened from its footer alone (`where`, `schema`)."""
    source = open_source(spec, storage)
    return ParquetRanges(source, source.files()[0])


def _strings_sample(ranges: ParquetRanges, rows: int = 256) -> pa.Table | None:
    """A few rows of the string columns (free text or categories?): their column chunks alone."""
    names = [f.name for f in ranges.schema if _is_text(f.type)]
    if not names or not ranges.row_group_rows:
        return None
    batch = next(iter(ranges.parquet.iter_batches(batch_size=rows, row_groups=[0], columns=names)), None)
    return None if batch is None else pa.Table.from_batches([batch])


def check_source_columns(where: str, schema: pa.Schema, config: DataConfig) -> None:
    """Every column the config names is in the schema; a missing one is one DataError naming
    the closest present column and the config key that named it."""
    named = {"data.label": [config.label], **{f"data.{k}": list(getattr(config, k)) for k in FEATURE_KEYS},
             "data.numeric": [(date_part(n) or (n, ""))[0] for n in config.numeric],
             "data.split_key": [config.split_key] if config.split_key else [],
             "data.time_column": [config.time_column] if config.time_column else []}
    for key, columns in named.items():
        for column in columns:
            _check_named(where, schema, column, key)


def _check_named(where: str, schema: pa.Schema, column: str, key: str) -> None:
    if column not in schema.names:
        near = difflib.get_close_matches(column, schema.names, n=1, cutoff=0.5)
        hint = f"did you mean '{near[0]}'? " if near else ""
        raise DataError(f"{where}: no column '{column}' (named by {key}); {hint}present: {', '.join(schema.names)}")


@dataclass
class InferredColumns:
    """The feature columns a schema suggests, and the columns left out with why."""

    columns: dict[str, list[str]] = field(default_factory=dict)
    left_out: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what the inference did that a user should know
    task: str | None = None  # inferred from the label's values, when data.task was not given
    task_why: str = ""
    positive: object = None  # a binary label of two values: the positive class chosen

    def overrides(self) -> list[str]:
        """As `--set` overrides a user can copy into a config."""
        task = [f"data.task={self.task}"] if self.task else []
        if self.positive is not None:
            task.append(f"data.positive={json.dumps(self.positive)}")
        return task + [f"data.{k}=[{', '.join(v)}]" for k, v in self.columns.items()]


def _feature_kind(f: pa.Field, sample: pa.Table | None) -> str | None:
    """The data.* list a column of this type belongs in (None: no feature type)."""
    t = f.type
    if pa.types.is_dictionary(t):
        return "categorical"
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        return "numeric"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "text" if _free_text(sample, f.name) else "categorical"
    if ((pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t))
            and (pa.types.is_floating(t.value_type) or pa.types.is_integer(t.value_type))):
        return "vector"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return "image"
    if pa.types.is_timestamp(t) or pa.types.is_date(t):
        return "dates"
    return None


def infer_columns(schema: pa.Schema, label: str, sample: pa.Table | None = None,
                  exclude: tuple[str, ...] = ()) -> InferredColumns:
    """Feature columns from the schema: numbers (and booleans) numeric, strings and dictionaries categorical
    (long free text as text, judged on `sample`), lists of numbers vectors, binary images."""
    if label not in schema.names:
        near = difflib.get_close_matches(label, schema.names, n=1, cutoff=0.5)
        hint = f"did you mean '{near[0]}'? " if near else ""
        raise DataError(f"no label column '{label}' (data.label); {hint}present: {', '.join(schema.names)}")
    found = InferredColumns({k: [] for k in FEATURE_KEYS})
    seen: set[str] = set()
    for f in schema:
        if f.name == label or f.name in exclude or f.name in seen:
            continue  # a repeated column is the schema check's to refuse, by name
        seen.add(f.name)
        kind = _feature_kind(f, sample)
        if kind is None:
            found.left_out[f.name] = f"type {f.type} is not a feature type"
        else:
            found.columns[kind].append(f.name)
    found.columns = {k: v for k, v in found.columns.items() if v or k in ("numeric", "categorical")}
    if found.columns.get("dates"):
        found.notes.append(f"date columns {found.columns['dates']} feed their year, month, day, day of week, day of "
                           "year and hour as numeric features (--set data.dates=[] leaves them out)")
    if not any(found.columns.values()):
        raise DataError(f"no feature column besides the label '{label}'; present: {', '.join(schema.names)}")
    return found


def _free_text(sample: pa.Table | None, name: str) -> bool:
    if sample is None or name not in sample.column_names:
        return False
    values = [v for v in sample.column(name).to_pylist() if v]
    return bool(values) and sum(len(v) for v in values) / len(values) > LONG_TEXT_CHARS
