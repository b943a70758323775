"""Which split each row belongs to: 0 train, 1 validation, 2 test.

A seeded hash, not a shuffle: deterministic and streaming. By default a row's split is a
function of the content of its Parquet row group (the sha256 of the group's bytes) and its row
there, so adding files to a source, or packing them in another order or on other machines,
never moves a row of the files already there. With `data.split_key` it is a function of that
column's value alone: every row of one key (a user, a device) falls in the same split, so no
key leaks between train and test, and a key keeps its split as data grows.
"""

from __future__ import annotations

import numpy as np

from training.config import DataConfig

__all__ = ["group_seed", "split_of_keys", "split_of_rows", "SPLIT_CODES"]

SPLIT_CODES = {"train": 0, "validation": 1, "test": 2}
_GOLDEN = 0x9E3779B97F4A7C15


def group_seed(sha256: str) -> int:
    """The split seed of a row group's rows, from the sha256 of its bytes."""
    return int(sha256[:16], 16)


def _split(x: np.ndarray, config: DataConfig) -> np.ndarray:
    """splitmix64's finaliser of x + the configured seed, then the split by the fractions."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(config.split_seed * _GOLDEN % 2**64)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    u = (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    out = np.zeros(len(u), dtype=np.int8)
    out[u < config.validation_fraction + config.test_fraction] = 1
    out[u < config.test_fraction] = 2
    return out


def split_of_rows(seed: int, start: int, count: int, config: DataConfig) -> np.ndarray:
    """The splits of rows [start, start + count) of the row group whose seed is `seed`."""
    with np.errstate(over="ignore"):
        x = np.arange(start, start + count, dtype=np.uint64) + np.uint64(seed) * np.uint64(_GOLDEN)
    return _split(x, config)


def split_of_keys(key_hashes: np.ndarray, config: DataConfig) -> np.ndarray:
    """The splits of rows whose `data.split_key` values hash to `key_hashes` (packing's category
    hash: a null key is hash 0, one key like any other)."""
    return _split(key_hashes.astype(np.uint64), config)
