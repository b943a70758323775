"""`data` and `preprocess`: the source, its label and feature columns, splits and packing; the
statistics and encodings fitted on the train split."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from training.config.marks import COMPUTED, COMPUTED_SINCE, OPERATIONAL
from training.config.section import DEMO_CATEGORICAL, DEMO_NUMERIC, _Section

__all__ = ["DATE_PARTS", "DataConfig", "PreprocessConfig", "WindowConfig", "date_part"]


class WindowConfig(_Section):
    last_segments: int | None = Field(
        None, gt=0, description="Keep only the newest N segments (by data.time_column when set, else by source file "
        "name, which orders daily files by day).", json_schema_extra=COMPUTED)
    last_days: float | None = Field(
        None, gt=0, description="Keep only segments whose newest row is within this many days of the newest row of "
        "all (needs data.time_column).", json_schema_extra=COMPUTED)


class DataConfig(_Section):
    source: str | None = Field(
        None,
        description="A Parquet or CSV file (.csv, .tsv, gzipped or not), a folder of them, or an s3:// prefix "
        "of them. Empty: the built-in synthetic "
        "click-through demo dataset, generated once under <storage.root>/demo/; demo:reviews and demo:shapes: "
        "the text and image demos.", json_schema_extra=OPERATIONAL
    )
    task: Literal["binary", "multiclass", "regression"] = Field(
        "binary", description="binary: a 0/1 label; multiclass: integer or string classes (the sorted distinct "
        "values of the train split); regression: a float label, standardised on the train split.",
        json_schema_extra=COMPUTED_SINCE)
    label: str = Field("clicked", description="Label column (its values: see data.task).", json_schema_extra=COMPUTED)
    positive: str | int | None = Field(
        None, description="data.task binary over a label of two values other than 0/1 (\"yes\"/\"no\", "
        "\"churned\"/\"stayed\", 1/2): the value that is the positive class. Empty: the rarer of the two, chosen "
        "when the task is inferred and printed with it.", json_schema_extra=COMPUTED_SINCE)
    negative: str | int | None = Field(
        None, description="The other value of such a label: set with data.positive when the task is inferred; a "
        "third value is then an error, never a new class.", json_schema_extra=COMPUTED_SINCE)
    drop_null_labels: bool = Field(
        False, description="Leave out rows whose label is null (their count is logged); off: a null label is an "
        "error naming its row.", json_schema_extra=COMPUTED_SINCE)
    numeric: list[str] = Field(list(DEMO_NUMERIC), description="Numeric feature columns; `column:part` (part one "
                               "of year, month, day, dayofweek, dayofyear, hour) is that part of a date column.",
                               json_schema_extra=COMPUTED)
    dates: list[str] = Field(
        [], description="Date and timestamp columns (any unit and time zone; local time where the zone is set), each "
        "fed as its year, month, day of month, day of week, day of year and hour, numeric features named "
        "`column:part`. Inferred for every temporal column when no feature column is given; [] leaves them out.",
        json_schema_extra=COMPUTED_SINCE)
    categorical: list[str] = Field(
        list(DEMO_CATEGORICAL), description="Categorical feature columns (any type).", json_schema_extra=COMPUTED
    )
    vector: list[str] = Field(
        [], description="Fixed-size list<float> columns (e.g. precomputed embeddings), fed as is.",
        json_schema_extra=COMPUTED_SINCE)
    text: list[str] = Field(
        [], description="String columns. Preprocessing fits a BPE tokenizer on the train split "
        "and stores token ids; the built-in model reads them with a transformer encoder.",
        json_schema_extra=COMPUTED_SINCE)
    image: list[str] = Field(
        [], description="Binary columns holding encoded PNG or JPEG images. Preprocessing decodes "
        "and resizes them once (preprocess.image_size); the built-in model reads them with a small CNN.",
        json_schema_extra=COMPUTED_SINCE)
    validation_fraction: float = Field(0.1, gt=0, lt=0.5, description="Share of rows in the validation split.", json_schema_extra=COMPUTED)
    test_fraction: float = Field(0.1, gt=0, lt=0.5, description="Share of rows in the test split.", json_schema_extra=COMPUTED)
    split_seed: int = Field(0, description="Seed of the deterministic row-to-split assignment.", json_schema_extra=COMPUTED)
    split_key: str | None = Field(
        None, description="A column (e.g. a user id) whose value alone decides a row's split: every row of one key "
        "falls in one split, so no key leaks between train and test. Empty: a row's split follows its file and its "
        "row there. Either way a row keeps its split as files are added.", json_schema_extra=COMPUTED_SINCE)
    rows_per_member: int = Field(4096, gt=0, description="Rows per tar member (micro-batch) in a shard.", json_schema_extra=COMPUTED)
    shard_size_mb: float = Field(16.0, gt=0, description="Target shard size in MB, tar headers counted.", json_schema_extra=COMPUTED)
    segment_rows: int = Field(
        1_048_576, gt=0, description="A source file is packed in segments of consecutive Parquet row groups of at most "
        "this many rows (a row group is never split). A segment is packed once, reused by every dataset that holds it, "
        "and is the unit of parallel packing.", json_schema_extra=COMPUTED_SINCE)
    time_column: str | None = Field(
        None, description="A timestamp, date or numeric (epoch seconds) column: each segment records its oldest and "
        "newest value, which orders segments and lets data.window.last_days keep recent ones.",
        json_schema_extra=COMPUTED_SINCE)
    window: WindowConfig = Field(default_factory=lambda: WindowConfig(), description="Train on recent segments only.",
                                 json_schema_extra=COMPUTED_SINCE)
    pack_parts: int = Field(
        8, ge=1, le=4096,
        description="At most this many segments are packed at once, one task each (across the workers of "
        "data.pack_cluster or of the flow's task runner); the shards are byte-identical for any value.", json_schema_extra=OPERATIONAL
    )
    pack_cluster: str | None = Field(
        None, pattern=r"^(tcp|tls|ucx)://[^\s/]+$",
        description="A Dask scheduler's address (tcp://host:8786): the segments are packed on that cluster's workers "
        "(needs the dask extra; with an s3:// source and root the workers share nothing else with the flow). Unset: on "
        "the flow's own task runner.", json_schema_extra=OPERATIONAL)

    @model_validator(mode="after")
    def _columns_distinct(self) -> DataConfig:
        for key in ("numeric", "categorical"):
            # A label named like one of the demo's default columns takes it out of that default
            # list; named in a list the config gives, it is listed twice (below).
            if key not in self.model_fields_set and self.label in getattr(self, key):
                object.__setattr__(self, key, [c for c in getattr(self, key) if c != self.label])
        columns = [self.label, *self.numeric, *self.dates, *self.categorical, *self.vector, *self.text, *self.image]
        repeated = sorted({c for c in columns if columns.count(c) > 1})
        if repeated:
            raise ValueError(f"columns listed twice across label/numeric/categorical/vector/text/image: {repeated}")
        if len(columns) == 1:
            raise ValueError("no feature columns: set data.numeric, data.categorical, data.vector, data.text "
                             "and/or data.image")
        if self.window.last_days is not None and self.time_column is None:
            raise ValueError("data.window.last_days needs data.time_column: set it to a timestamp or date column")
        if self.negative is not None and self.positive is None:
            raise ValueError("data.negative needs data.positive: name the positive class")
        if self.positive is not None and self.task != "binary":
            raise ValueError(f"data.positive is for data.task binary, not {self.task}: unset it, or set data.task: binary")
        if self.positive is not None and self.positive == self.negative:
            raise ValueError(f"data.positive and data.negative are both {self.positive!r}: they name a label's two values")
        return self


    @property
    def numeric_features(self) -> list[str]:
        """The numeric features, in the order the shards store them: data.numeric, then every
        part of every data.dates column."""
        return [*self.numeric, *(f"{d}:{part}" for d in self.dates for part in DATE_PARTS)]

    @property
    def numeric_columns(self) -> list[str]:
        """The source columns the numeric features read (a date part reads its date column)."""
        return list(dict.fromkeys((date_part(n) or (n, ""))[0] for n in self.numeric_features))


DATE_PARTS = ("year", "month", "day", "dayofweek", "dayofyear", "hour")


def date_part(name: str) -> tuple[str, str] | None:
    """(the date column, the part) of a numeric feature named `column:part`; None for a column."""
    base, sep, part = name.rpartition(":")
    return (base, part) if sep and base and part in DATE_PARTS else None


class PreprocessConfig(_Section):
    max_vocab: int = Field(1000, gt=0, description="Most frequent categories kept per column; others share one bucket.", json_schema_extra=COMPUTED)
    min_count: int = Field(1, gt=0, description="Categories seen fewer times in the train split are treated as unknown.", json_schema_extra=COMPUTED)
    vocab_size: int = Field(8000, ge=64, le=1_000_000, description="data.text: size of the BPE vocabulary fitted "
                            "on the train split (special tokens included).", json_schema_extra=COMPUTED_SINCE)
    max_tokens: int = Field(128, ge=2, le=65_536, description="data.text: tokens kept per text (a leading [CLS] "
                            "included); longer texts are truncated, shorter ones padded and masked.",
                            json_schema_extra=COMPUTED_SINCE)
    image_size: int | None = Field(None, ge=4, le=4096, description="data.image: images are decoded once, converted "
                                   "to RGB and resized to image_size x image_size. Unset: their own size (the largest "
                                   "side of the first train images), at most 32; smaller images are never scaled up.",
                                   json_schema_extra=COMPUTED_SINCE)
    numeric_bins: int = Field(
        48, ge=2, le=1024, description="Quantile bins of each numeric column's train values, for "
        "model.numeric_embedding: piecewise (fewer where a column has fewer distinct values).",
        json_schema_extra=COMPUTED_SINCE)
    target_transform: Literal["auto", "standardize", "log1p", "quantile"] = Field(
        "auto", description="Regression: the label's transform for training, inverted exactly in evaluation, "
        "predict and the export. standardize; log1p (labels >= 0), then standardised; quantile (the train split's "
        "CDF, then the normal's inverse CDF); auto: log1p when the train labels are all > 0 with a skewness over 1 "
        "and their log's within ±1 (a price, a duration), else standardize.",
        json_schema_extra=COMPUTED_SINCE)
