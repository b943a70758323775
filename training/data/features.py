"""Feature statistics fitted on the train split, and the transform that applies them.

Numeric columns are standardised with the train mean and std (nulls become the mean).
Categorical columns arrive as 63-bit hashes from packing; the `max_vocab` most frequent train
values (seen at least `min_count` times) get indices 1..V, everything else shares index 0.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from training.config import PreprocessConfig, fingerprint, fingerprinted
from training.data.packing import DatasetManifest
from training.data.shard_cache import local_shard
from training.data.shards import ShardReader
from training.errors import DataError
from training.storage import write_atomic

__all__ = ["PREPROCESS_VERSION", "FeatureStats", "fit_feature_stats", "preprocess_key", "verified_feature_stats",
           "checksum_path"]

log = logging.getLogger(__name__)

# Bump when the fitting or transform code changes meaning: it is part of the cache key.
PREPROCESS_VERSION = "1"


@dataclass
class FeatureStats:
    numeric: list[str]
    categorical: list[str]
    mean: list[float]
    std: list[float]
    vocab: list[list[int]]  # per categorical column: hashes in index order (index = position + 1)
    key: str = ""
    # Since data.task and data.vector (statistics written before read as binary, no vectors):
    task: str = "binary"
    label: str = ""
    classes: list[Any] = field(default_factory=list)  # multiclass: the label value of each output
    label_mean: float = 0.0  # regression: the model predicts (label - mean) / std
    label_std: float = 1.0
    vector: list[str] = field(default_factory=list)
    vector_dims: list[int] = field(default_factory=list)

    @property
    def cardinalities(self) -> list[int]:
        return [len(v) + 1 for v in self.vocab]

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> FeatureStats:
        return cls(**json.loads(text))

    def transformer(self) -> FeatureTransform:
        return FeatureTransform(self)


class FeatureTransform:
    """Vectorised transform of rows (a micro-batch or a whole shard); picklable for DataLoader workers."""

    def __init__(self, stats: FeatureStats) -> None:
        self.mean = np.asarray(stats.mean, dtype=np.float32)
        self.inv_std = (1.0 / np.asarray(stats.std, dtype=np.float64)).astype(np.float32)
        self.vocab = [np.asarray(hashes, dtype=np.int64) for hashes in stats.vocab]
        self._value_sets: list[pa.Array] | None = None

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_value_sets": None}  # rebuilt on first use in the worker

    def __call__(self, num: np.ndarray, cat: np.ndarray, out_num: np.ndarray | None = None,
                 out_cat: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Standardised numerics (float32) and vocabulary indices (int64), into `out_*` when given."""
        if self._value_sets is None:
            self._value_sets = [pa.array(v) for v in self.vocab]
        x = np.subtract(num, self.mean, out=out_num, dtype=np.float32)
        x *= self.inv_std
        np.nan_to_num(x, copy=False, nan=0.0)
        out = np.empty(cat.shape, dtype=np.int64) if out_cat is None else out_cat
        for j, values in enumerate(self._value_sets):
            if len(values) == 0:
                out[:, j] = 0
                continue
            # Arrow's hash lookup: 2.5x faster than np.searchsorted over the sorted vocabulary
            # (measured, 262k rows), and it releases the GIL, so it overlaps the training step
            # when a shard is prepared in the background. Position p in the vocabulary is
            # index p + 1; a value not in it (null here) is index 0.
            found = pc.index_in(pa.array(cat[:, j]), value_set=values).fill_null(-1)
            np.add(found.to_numpy(), 1, out=out[:, j], casting="unsafe")
        return x, out


def preprocess_key(dataset_fingerprint: str, config: PreprocessConfig) -> str:
    return fingerprint("preprocess", PREPROCESS_VERSION, dataset_fingerprint, fingerprinted(config))


def checksum_path(stats_path: Path) -> Path:
    """`feature_stats.json.sha256`: written after the statistics, so its presence marks them complete."""
    return stats_path.with_name(stats_path.name + ".sha256")


def verified_feature_stats(stats_path: Path) -> FeatureStats | None:
    """The statistics at `stats_path` if they match their checksum; None (with a warning when
    something is there but wrong) otherwise. They are derived data: the caller fits them again."""
    if not stats_path.exists():
        return None
    try:
        data = stats_path.read_bytes()
        expected = checksum_path(stats_path).read_text().strip()
        if hashlib.sha256(data).hexdigest() != expected:
            raise ValueError("sha256 mismatch")
        return FeatureStats.from_json(data.decode())
    except (OSError, ValueError, TypeError, KeyError) as err:
        reason = "no checksum" if isinstance(err, FileNotFoundError) else str(err) or type(err).__name__
        log.warning("feature statistics %s failed verification (%s): fitting them again", stats_path, reason)
        return None


def fit_feature_stats(
    dataset_dir: Path, manifest: DatasetManifest, config: PreprocessConfig, out_root: Path
) -> tuple[Path, FeatureStats]:
    """Fit on the train split and write `<out_root>/<key>/feature_stats.json` and its sha256
    (each atomic, the checksum last); verified statistics already there are reused."""
    key = preprocess_key(manifest.fingerprint, config)
    out_path = out_root / key / "feature_stats.json"
    existing = verified_feature_stats(out_path)
    if existing is not None:
        return out_path, existing

    n_num, n_cat = len(manifest.numeric), len(manifest.categorical)
    total = np.zeros(n_num, dtype=np.float64)
    total_sq = np.zeros(n_num, dtype=np.float64)
    count = np.zeros(n_num, dtype=np.int64)
    counts: list[dict[int, int]] = [{} for _ in range(n_cat)]
    label_sum = label_sq = 0.0
    for shard in manifest.shards_of("train"):
        reader = ShardReader(local_shard(dataset_dir, shard.name, shard.bytes, shard.sha256)[0])
        try:
            for key_ in reader.keys:
                block = reader.block(key_)
                num = block["num"].astype(np.float64)
                finite = np.isfinite(num)
                total += np.where(finite, num, 0).sum(axis=0)
                total_sq += np.where(finite, num * num, 0).sum(axis=0)
                count += finite.sum(axis=0)
                label = block["label"].astype(np.float64)
                label_sum += float(label.sum())
                label_sq += float((label * label).sum())
                for j in range(n_cat):
                    values, freq = np.unique(block["cat"][:, j], return_counts=True)
                    d = counts[j]
                    for v, c in zip(values.tolist(), freq.tolist(), strict=True):
                        d[v] = d.get(v, 0) + c
            del block  # drop the views into the mmap before closing it
        finally:
            reader.close()
    empty = [name for name, n in zip(manifest.numeric, count.tolist(), strict=True) if n == 0]
    if empty:
        # Imputing the mean of nothing would feed the model a constant 0 without a word.
        raise DataError(f"numeric column {empty[0]!r} has no non-null value in the train split of dataset "
                        f"{manifest.fingerprint}; fix the source or drop it from data.numeric")
    mean = np.divide(total, count, out=np.zeros_like(total), where=count > 0)
    var = np.divide(total_sq, count, out=np.zeros_like(total), where=count > 0) - mean**2
    std = np.sqrt(np.maximum(var, 0))
    std[std < 1e-12] = 1.0  # constant column: leave it centred, do not divide by ~0
    vocab = []
    for d in counts:
        kept = [(c, h) for h, c in d.items() if c >= config.min_count and h != 0]
        kept.sort(key=lambda t: (-t[0], t[1]))
        vocab.append([h for _, h in kept[: config.max_vocab]])
    stats = FeatureStats(
        numeric=list(manifest.numeric),
        categorical=list(manifest.categorical),
        mean=mean.tolist(),
        std=std.tolist(),
        vocab=vocab,
        key=key,
        task=manifest.task, label=manifest.label, classes=list(manifest.classes),
        vector=list(manifest.vector), vector_dims=list(manifest.vector_dims),
    )
    if manifest.task == "regression":
        n = manifest.rows["train"]
        stats.label_mean = label_sum / n
        # A constant label keeps std 1: the model then learns the offset alone.
        std_label = float(np.sqrt(max(label_sq / n - stats.label_mean**2, 0.0)))
        stats.label_std = std_label if std_label > 1e-12 else 1.0
    out_path.parent.mkdir(parents=True, exist_ok=True)
    data = stats.to_json().encode()
    write_atomic(out_path, data)
    write_atomic(checksum_path(out_path), hashlib.sha256(data).hexdigest().encode())
    return out_path, stats
