"""Feature statistics fitted on the train split, and the transform that applies them.

Numeric columns are standardised with the train mean and std (nulls become the mean).
Categorical columns arrive as 63-bit hashes from packing; the `max_vocab` most frequent train
values (seen at least `min_count` times) get indices 1..V, everything else shares index 0.
Text columns get a BPE tokenizer fitted on the train split; image columns the per-channel train
mean and std of their pixels.

Texts and images are turned into token ids and pixels once, by preprocessing: the derived
arrays of each shard are stored beside the statistics, `<key>/arrays/<shard>.npz`, listed with
their sha256 in `<key>/arrays/arrays.json` (written last), so training never tokenizes or decodes.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import zipfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Generator, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from training.config import PreprocessConfig, fingerprint, fingerprinted
from training.data.batch import Columns, present
from training.data.ingest.arrow_buffers import arrow_int64, int32_values, validity
from training.data.ingest.ragged import Ragged
from training.data.ingest.segment_stats import SegmentStats, SegmentStatsBuilder, merge_stats
from training.data.ingest.segments import load_segment, read_stats
from training.data.load.shard_cache import local_shard
from training.data.manifest import DatasetManifest, segments_dir, shard_folder
from training.data.prepare.drift import drift_reference
from training.data.prepare.images import AUTO_SIZE_CAP, UndecodableImage, decode_images, largest_side
from training.data.prepare.target import weighted_quantiles
from training.data.prepare.text import TextEncoder, fit_tokenizer, tokenizers_version
from training.data.shards import ShardReader, encode_npy
from training.data.stored_rows import StoredRows
from training.errors import DataError
from training.storage.files import read_json, read_pinned, sha256_file, write_atomic, write_json_atomic

__all__ = ["PREPROCESS_VERSION", "FeatureStats", "FeatureTransform", "fit_feature_stats", "preprocess_key",
           "verified_feature_stats", "checksum_path", "derived_rels", "write_derived_arrays", "DERIVED_DIR",
           "DERIVED_INDEX", "dataset_stats", "grown_for_warm_start"]

_CHUNK_MEMBERS = 16  # members transformed per call: 64k rows at the default 4096 per member

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
    label_mean: float = 0.0  # regression: the model predicts (g(label) - mean) / std
    label_std: float = 1.0
    # Since preprocess.target_transform: g (training.data.prepare.target); statistics written before are
    # standardize.
    target_transform: str = "standardize"
    target_knots: list[float] = field(default_factory=list)  # quantile: the label at levels i / 1000; log1p: min, max
    vector: list[str] = field(default_factory=list)
    vector_dims: list[int] = field(default_factory=list)
    # Since data.text and data.image:
    text: list[str] = field(default_factory=list)
    tokenizer: str = ""  # the fitted tokenizer's JSON (tokenizers.Tokenizer.from_str reads it)
    max_tokens: int = 0
    image: list[str] = field(default_factory=list)
    image_size: int = 0
    image_mean: list[float] = field(default_factory=list)  # per RGB channel, on the 0-255 scale
    image_std: list[float] = field(default_factory=list)
    # Since segment datasets: the segments fitted on, and the features' training distribution
    # (training.data.prepare.drift.DriftReference as JSON), against which new data's drift is measured.
    segments: list[str] = field(default_factory=list)
    drift: dict[str, Any] = field(default_factory=dict)
    # Since piecewise-linear numeric embeddings: each numeric column's quantile bin edges, in the
    # standardised units the model sees (preprocess.numeric_bins bins at most).
    numeric_bins: list[list[float]] = field(default_factory=list)

    @property
    def cardinalities(self) -> list[int]:
        return [len(v) + 1 for v in self.vocab]

    @property
    def derives(self) -> bool:
        """Whether preprocessing stores derived arrays (token ids, pixels) for this data."""
        return bool(self.text or self.image)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> FeatureStats:
        return cls(**json.loads(text))

    def transformer(self, derived_dir: Path | None = None, index_sha256: str | None = None) -> FeatureTransform:
        """The transform; with `derived_dir` (preprocessing's arrays for these statistics) it reads
        token ids and pixels from there, and otherwise computes them (an evaluation pass over
        another dataset, with a champion's statistics). With `index_sha256`, the arrays' index
        must have that digest (a training job's `derived_sha256`)."""
        return FeatureTransform(self, derived_dir, index_sha256)


@dataclass(frozen=True)
class Derived:
    """A shard's token ids and pixels, derived from its text and image members by
    preprocessing (stored as `<shard>.npz`, one member per group) or on the fly."""

    NAMES = ("tok", "ntok", "pix")

    tok: np.ndarray | None = None
    ntok: np.ndarray | None = None
    pix: np.ndarray | None = None

    def groups(self) -> dict[str, np.ndarray]:
        """The groups it has, by name: the batch groups they become, the npz members they are stored as."""
        return {name: value for name in self.NAMES if (value := getattr(self, name)) is not None}


class FeatureTransform:
    """Vectorised transform of rows (a micro-batch or a whole shard); picklable for DataLoader workers."""

    def __init__(self, stats: FeatureStats, derived_dir: Path | None = None, index_sha256: str | None = None) -> None:
        self.mean = np.asarray(stats.mean, dtype=np.float32)
        self.inv_std = (1.0 / np.asarray(stats.std, dtype=np.float64)).astype(np.float32)
        self.vocab = [np.asarray(hashes, dtype=np.int64) for hashes in stats.vocab]
        self._value_sets: list[pa.Array] | None = None
        self.text_encoder = TextEncoder(stats.tokenizer, stats.max_tokens) if stats.text else None
        self.text, self.image, self.image_size = list(stats.text), list(stats.image), stats.image_size
        self.derived_dir = derived_dir
        self.index_sha256 = index_sha256
        self._derived_index: dict[str, list[Any]] | None = None

    def shard(self, blocks: list[StoredRows], shard_name: str, buffers: dict[str, np.ndarray] | None = None) -> Columns:
        """A whole shard's micro-batches transformed, rows in file order: num, cat, label, vec,
        and tok/ntok (token ids and lengths, per text column) and pix (per image column).

        Once per shard rather than once per batch (per-call numpy overhead was 58% of a 256-row
        batch's time in a profile), over chunks of 16 members concatenated: called per member,
        its fixed cost per call was a third of the shard's load time (42 ms vs 30 ms a shard).

        With `buffers` (a dict the caller keeps), num/cat/label/vec are written into arrays held
        there, grown as needed, and the result is views of them, valid until the next call: for
        a caller that copies the rows elsewhere anyway (the loader puts them in an epoch's order),
        this saves a shard's worth of new memory per call, whose first touch cost about as much
        as the numeric transform itself (6 of 13 ms a shard, 262k rows, on the 2-core VM)."""
        rows = sum(block.rows for block in blocks)
        first = blocks[0].prepared()
        out = Columns.of({k: _buffer(buffers, k, (rows, *v.shape[1:]), np.float32 if k == "num" else v.dtype)
                          for k, v in first.items()})
        lo = 0
        for start in range(0, len(blocks), _CHUNK_MEMBERS):
            chunk = [block.prepared() for block in blocks[start : start + _CHUNK_MEMBERS]]
            hi = lo + sum(block.rows for block in chunk)
            num, cat = (np.concatenate([block[k] for block in chunk],
                                       out=_buffer(buffers, f"chunk.{k}", (hi - lo, *first[k].shape[1:]), first[k].dtype))
                        for k in ("num", "cat"))
            self(num, cat, out.num[lo:hi], out.cat[lo:hi])
            for k, held in out.items():
                if k not in ("num", "cat"):  # stored ready for the model: copied as they are
                    np.concatenate([block[k] for block in chunk], out=held[lo:hi])
            lo = hi
        if self.text or self.image:
            out = out.replace(**self.derived(blocks, shard_name).groups())
        return out

    def derived(self, blocks: list[StoredRows], shard_name: str) -> Derived:
        """Token ids and pixels of a shard: preprocessing's stored arrays when there are any."""
        if self.derived_dir is not None:
            stored = self._stored(shard_name)
            if stored is not None:
                return stored
        return self.derive(blocks)

    def derive(self, blocks: list[StoredRows]) -> Derived:
        """tok (rows, texts, max_tokens), ntok (rows, texts), pix (rows, images, 3, size, size)."""
        tok = ntok = pix = None
        if self.text_encoder is not None:
            encoded = [self.text_encoder.encode(Ragged.concat([b.texts[j] for b in blocks])) for j in range(len(self.text))]
            tok = np.stack([ids for ids, _ in encoded], axis=1)
            ntok = np.stack([n for _, n in encoded], axis=1)
        if self.image:
            images = []
            for j, name in enumerate(self.image):
                try:
                    images.append(decode_images(Ragged.concat([b.images[j] for b in blocks]), self.image_size))
                except UndecodableImage as err:
                    # Rows with image members carry their source rows (`row`): packing stores both.
                    row = int(np.concatenate([b.row for b in blocks if b.row is not None])[err.index])
                    raise UndecodableRow(name, row, str(err)) from None
            pix = np.stack(images, axis=1)
        return Derived(tok, ntok, pix)

    def _stored(self, shard_name: str) -> Derived | None:
        assert self.derived_dir is not None
        if self._derived_index is None:
            index = self.derived_dir / DERIVED_INDEX
            if self.index_sha256 is not None:
                # Pinned by the parent, which read it before it handed the job over.
                self._derived_index = json.loads(read_pinned(index, self.index_sha256, "the derived arrays' index"))
            else:
                self._derived_index = read_json(index) or {}
        entry = self._derived_index.get(shard_name)
        if entry is None:
            return None
        path = self.derived_dir / _derived_name(shard_name)
        if not path.exists():
            return None  # cleaned away since preprocessing: computed again from the shard
        if sha256_file(path) != entry[1]:
            raise DataError(f"{path}: sha256 does not match {DERIVED_INDEX} (corrupt); delete "
                            f"{self.derived_dir.parent} and rerun: preprocessing writes it again")
        with np.load(path) as stored:
            unknown = set(stored.files) - set(Derived.NAMES)
            if unknown:
                raise DataError(f"{path}: holds arrays {sorted(unknown)}, not derived ones; delete "
                                f"{self.derived_dir.parent} and rerun: preprocessing writes it again")
            return Derived(**{k: stored[k] for k in stored.files})

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_value_sets": None}  # rebuilt on first use in the worker

    def __call__(self, num: np.ndarray, cat: np.ndarray, out_num: np.ndarray | None = None,
                 out_cat: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Standardised numerics (float32) and vocabulary indices (int64), into `out_*` when given."""
        if self._value_sets is None:
            self._value_sets = [arrow_int64(v) for v in self.vocab]
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
            found = pc.index_in(arrow_int64(cat[:, j]), value_set=values)
            np.add(int32_values(found), 1, out=out[:, j], casting="unsafe")
            if found.null_count:
                out[:, j] *= validity(found)
        return x, out


def _buffer(buffers: dict[str, np.ndarray] | None, key: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An array of `shape`: new, or the first rows of buffers[key] (replaced when too small)."""
    if buffers is None:
        return np.empty(shape, dtype=dtype)
    held = buffers.get(key)
    if held is None or held.shape[1:] != shape[1:] or held.dtype != dtype or len(held) < shape[0]:
        held = buffers[key] = np.empty(shape, dtype=dtype)
    return held[: shape[0]]


class UndecodableRow(DataError):
    def __init__(self, column: str, row: int, reason: str) -> None:
        super().__init__(f"image column '{column}' cannot be decoded at source row {row} ({reason})")
        self.column, self.row, self.reason = column, row, reason


DERIVED_DIR = "arrays"
DERIVED_INDEX = "arrays.json"


def _derived_name(shard_name: str) -> str:
    return shard_name.removesuffix(".tar") + ".npz"


def derived_rels(stats_rel_dir: str, manifest: DatasetManifest) -> list[str]:
    """The derived arrays' paths under the storage root, the index last (it marks them complete)."""
    base = f"{stats_rel_dir}/{DERIVED_DIR}"
    return [f"{base}/{_derived_name(s.key)}" for s in manifest.shards] + [f"{base}/{DERIVED_INDEX}"]


def preprocess_key(dataset_fingerprint: str, config: PreprocessConfig, text: bool = False,
                   regression: bool = False, image: bool = False) -> str:
    """The content address of preprocessing; with text columns the tokenizers release is part
    of it, since another release may fit another tokenizer from the same texts. A regression
    label's transform is part of it whatever its setting: statistics fitted before the setting
    existed hold `standardize`, which `auto` may not choose. With image columns, an unset
    image_size (the images' own size) is too: before it existed, unset meant 32 px."""
    parts: list[Any] = ["preprocess", PREPROCESS_VERSION, dataset_fingerprint, fingerprinted(config)]
    if text:
        parts.append(f"tokenizers-{tokenizers_version()}")
    if regression:
        parts.append(f"target-{config.target_transform}")
    if image and config.image_size is None:
        parts.append("image-size-own")
    return fingerprint(*parts)


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
        stats = FeatureStats.from_json(data.decode())
    except (OSError, ValueError, TypeError, KeyError) as err:
        reason = "no checksum" if isinstance(err, FileNotFoundError) else str(err) or type(err).__name__
        log.warning("feature statistics %s failed verification (%s): fitting them again", stats_path, reason)
        return None
    if stats.numeric and not stats.numeric_bins:
        # Fitted by a version before piecewise-linear embeddings and drift references: the same
        # statistics are fitted again, with what they lack.
        log.info("feature statistics %s predate numeric bins and drift references: fitting them again", stats_path)
        return None
    return stats


def fit_feature_stats(
    dataset_dir: Path, manifest: DatasetManifest, config: PreprocessConfig, out_root: Path
) -> tuple[Path, FeatureStats]:
    """Fit on the train split and write `<out_root>/<key>/feature_stats.json` and its sha256
    (each atomic, the checksum last), after the derived arrays of text and image columns; verified
    statistics already there (with their arrays) are reused."""
    key = preprocess_key(manifest.fingerprint, config, bool(manifest.text), manifest.task == "regression",
                         bool(manifest.image))
    out_path = out_root / key / "feature_stats.json"
    existing = verified_feature_stats(out_path)
    if existing is not None and (not existing.derives or (out_path.parent / DERIVED_DIR / DERIVED_INDEX).exists()):
        return out_path, existing

    stats = _tabular_stats(dataset_dir, manifest, config)
    stats.key = key
    if manifest.text:
        stats.text, stats.max_tokens = list(manifest.text), config.max_tokens
        stats.tokenizer = _fit_text(dataset_dir, manifest, config.vocab_size)
    if manifest.image:
        stats.image = list(manifest.image)
        stats.image_size = config.image_size or _auto_image_size(dataset_dir, manifest)
    if stats.derives:
        stats.image_mean, stats.image_std = write_derived_arrays(dataset_dir, manifest, stats,
                                                                 out_path.parent / DERIVED_DIR)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    data = stats.to_json().encode()
    write_atomic(out_path, data)
    write_atomic(checksum_path(out_path), hashlib.sha256(data).hexdigest().encode())
    return out_path, stats


def _auto_image_size(dataset_dir: Path, manifest: DatasetManifest, sample: int = 256) -> int:
    """The images' own largest side (the first `sample` train rows), at most AUTO_SIZE_CAP:
    smaller images are never scaled up."""
    side, seen = 0, 0
    with contextlib.closing(_train_blocks(dataset_dir, manifest)) as blocks:
        for block in blocks:
            columns = list(block.images)
            side = max(side, *(largest_side(images, sample - seen) for images in columns))
            seen += len(columns[0])
            if seen >= sample:
                break
    return min(AUTO_SIZE_CAP, side) if side else AUTO_SIZE_CAP


def _train_blocks(dataset_dir: Path, manifest: DatasetManifest, split: str = "train") -> Generator[StoredRows, None, None]:
    """Every micro-batch of a split's shards, in order (views into the mapped shard: use them
    before asking for the next)."""
    for shard in manifest.shards_of(split):
        reader = ShardReader(local_shard(shard_folder(dataset_dir, shard), shard.name, shard.bytes, shard.sha256)[0])
        try:
            for key_ in reader.keys:
                yield reader.block(key_)
        finally:
            reader.close()


def dataset_stats(dataset_dir: Path, manifest: DatasetManifest) -> SegmentStats:
    """The sufficient statistics of the dataset's train rows: its segments' merged (each read
    from its small stats.npz), or for a format-1 dataset, a pass over its train shards."""
    regression = manifest.task == "regression"
    if manifest.segments:
        parts = []
        for ref in manifest.segments:
            folder = segments_dir(dataset_dir) / ref.key
            segment = load_segment(folder)
            if segment is None:
                raise DataError(f"segment {ref.key} of dataset {manifest.fingerprint} is missing; run the same "
                                "command again: the pack stage packs it again")
            parts.append(read_stats(folder, segment, len(manifest.categorical), regression))
        return merge_stats(parts)
    builder = SegmentStatsBuilder(len(manifest.numeric), len(manifest.categorical), regression, manifest.train_rows)
    for block in _train_blocks(dataset_dir, manifest):
        builder.add(block.num, block.cat, present(block.label, "label"))
        del block  # drop the views into the mmap before it is closed
    return builder.finish()


def _tabular_stats(dataset_dir: Path, manifest: DatasetManifest, config: PreprocessConfig) -> FeatureStats:
    merged = dataset_stats(dataset_dir, manifest)
    count = merged.numeric.n
    empty = [name for name, n in zip(manifest.numeric, count.tolist(), strict=True) if n == 0]
    if empty:
        # Imputing the mean of nothing would feed the model a constant 0 without a word.
        raise DataError(f"numeric column {empty[0]!r} has no non-null value in the train split of dataset "
                        f"{manifest.fingerprint}; fix the source or drop it from data.numeric")
    std = merged.numeric.std.copy()
    std[std < 1e-12] = 1.0  # constant column: leave it centred, do not divide by ~0
    stats = FeatureStats(
        numeric=list(manifest.numeric), categorical=list(manifest.categorical), mean=merged.numeric.mean.tolist(),
        std=std.tolist(), vocab=[_vocabulary(c.values, c.counts, config) for c in merged.categories],
        task=manifest.task, label=manifest.label, classes=list(manifest.classes), vector=list(manifest.vector),
        vector_dims=list(manifest.vector_dims), segments=[s.key for s in manifest.segments],
        drift=drift_reference(merged, list(manifest.numeric), list(manifest.categorical)).model_dump(mode="json"),
    )
    stats.numeric_bins = _numeric_bins(merged, stats, config.numeric_bins)
    if merged.target is not None:
        try:
            fit = merged.target.fit(config.target_transform)
        except ValueError as err:
            raise DataError(f"preprocess.target_transform: {err} (label column {manifest.label!r}); use quantile "
                            "or standardize, or auto") from None
        stats.target_transform, stats.target_knots = fit.kind, fit.knots
        stats.label_mean, stats.label_std = fit.mean, fit.std
    return stats


def _numeric_bins(merged: SegmentStats, stats: FeatureStats, bins: int) -> list[list[float]]:
    """Each numeric column's quantile bin edges (at least two), in standardised units, from the
    train rows' sample: nulls enter the model as 0, the mean, so they count as 0 here too."""
    mean, std = np.asarray(stats.mean), np.asarray(stats.std)
    levels = np.linspace(0.0, 1.0, bins + 1)
    out = []
    for j in range(len(stats.numeric)):
        x = (merged.numeric_sample[:, j].astype(np.float64) - mean[j]) / std[j]
        x = np.where(np.isfinite(x), x, 0.0)
        order = np.argsort(x, kind="stable")
        edges = np.unique(weighted_quantiles(x[order], merged.numeric_sample_weight[order], levels))
        if edges.size < 2:  # a constant column: one bin around it
            centre = float(edges[0]) if edges.size else 0.0
            edges = np.array([centre - 1.0, centre + 1.0])
        out.append([float(v) for v in edges])
    return out


def _vocabulary(values: np.ndarray, counts: np.ndarray, config: PreprocessConfig) -> list[int]:
    """The `max_vocab` most frequent hashes seen at least `min_count` times, most frequent first
    (ties by hash); the null hash 0 is never in it."""
    kept = (counts >= config.min_count) & (values != 0)
    values, counts = values[kept], counts[kept]
    order = np.lexsort((values, -counts))[: config.max_vocab]
    return [int(v) for v in values[order]]


def _fit_text(dataset_dir: Path, manifest: DatasetManifest, vocab_size: int) -> str:
    """The tokenizer's JSON, fitted on every text column's train values."""
    non_empty = [0] * len(manifest.text)

    def texts() -> Iterator[str]:
        for block in _train_blocks(dataset_dir, manifest):
            for j in range(len(manifest.text)):
                values = block.texts[j]
                non_empty[j] += int(np.count_nonzero(np.diff(values.offsets)))
                yield from values.texts()

    tokenizer = fit_tokenizer(texts(), vocab_size)
    for name, n in zip(manifest.text, non_empty, strict=True):
        if n == 0:
            raise DataError(f"text column {name!r} is empty (null or '') in every row of the train split of "
                            f"dataset {manifest.fingerprint}; fix the source or drop it from data.text")
    return tokenizer


def write_derived_arrays(dataset_dir: Path, manifest: DatasetManifest, stats: FeatureStats,
                         out_dir: Path) -> tuple[list[float], list[float]]:
    """Token ids and pixels of every shard under `out_dir` (the index last); returns the train
    pixels' per-channel mean and std (empty without image columns)."""
    transform = FeatureTransform(stats)
    out_dir.mkdir(parents=True, exist_ok=True)
    index: dict[str, list[Any]] = {}
    total = np.zeros(3)
    total_sq = np.zeros(3)
    pixels = 0
    for shard in manifest.shards:
        reader = ShardReader(local_shard(shard_folder(dataset_dir, shard), shard.name, shard.bytes, shard.sha256)[0])
        try:
            blocks = [reader.block(k) for k in reader.keys]
            derived = transform.derive(blocks)
        except UndecodableRow as err:
            file, row = manifest.source_row(shard, err.row)
            raise DataError(f"{file}: image column '{err.column}' cannot be decoded at row {row} "
                            f"({err.reason}); fix or drop the row") from None
        finally:
            blocks = []
            reader.close()
        if derived.pix is not None and shard.split == "train":
            per_channel = derived.pix.transpose(2, 0, 1, 3, 4).reshape(3, -1).astype(np.float64)
            total += per_channel.sum(axis=1)
            total_sq += (per_channel * per_channel).sum(axis=1)
            pixels += per_channel.shape[1]
        path = out_dir / _derived_name(shard.key)
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as archive:  # np.load reads it as an .npz
            for name, values in derived.groups().items():
                # A fixed date: np.savez stamps the time, and the same input should give the same bytes.
                archive.writestr(zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0)), encode_npy(values))
        payload = buf.getvalue()  # one copy of the shard's arrays, not one per use
        write_atomic(path, payload)
        index[shard.key] = [len(payload), hashlib.sha256(payload).hexdigest()]
    write_json_atomic(out_dir / DERIVED_INDEX, index)
    if not pixels:
        return [], []
    mean = total / pixels
    std = np.sqrt(np.maximum(total_sq / pixels - mean**2, 0.0))
    return mean.tolist(), np.where(std < 1e-6, 1.0, std).tolist()


def grown_for_warm_start(champion: FeatureStats, dataset_dir: Path, manifest: DatasetManifest,
                         config: PreprocessConfig) -> FeatureStats:
    """The champion's statistics for a warm start on this dataset: its input scaling and its
    vocabularies as they are (an embedding row keeps meaning the same category), each vocabulary
    grown by the categories this dataset's train split adds, most frequent first, up to
    `preprocess.max_vocab`. A new category's index comes after every old one, so the champion's
    weights load as they are, plus fresh rows (`training.model.package.load_warm_start`). The
    classes are this dataset's (a warm start may add classes, never drop one; the output layer's
    rows are moved to them by value). The drift reference describes this dataset: the model is
    trained on it."""
    merged = dataset_stats(dataset_dir, manifest)
    vocab = []
    for old, counts in zip(champion.vocab, merged.categories, strict=True):
        room = config.max_vocab - len(old)
        known = set(old)
        new = [h for h in _vocabulary(counts.values, counts.counts, config) if h not in known] if room > 0 else []
        vocab.append([*old, *new[:max(room, 0)]])
    return replace(champion, vocab=vocab, classes=list(manifest.classes), segments=[s.key for s in manifest.segments],
                   drift=drift_reference(merged, list(manifest.numeric), list(manifest.categorical))
                   .model_dump(mode="json"))
