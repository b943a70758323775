"""The train split held whole in the training device's memory, batches gathered there by index.

A streaming step on a GPU copies its batch from pinned host memory each step, behind the host's
other work; airbench and similar fast loops keep the whole dataset on the device instead and
gather each batch with one indexing kernel. `ResidentBatches` does that with the exact rows, in
the exact order, of `ShardBatches` (shards permuted by (seed, epoch), rows within each shard by
(seed, epoch, shard)): batch b of an epoch is the same rows either way, so a run trains the same
model whichever path fed it, and a checkpoint's stream position means the same thing on both.

Per epoch, one index of the epoch's row order is computed on the host and copied to the device
once; a step then slices it and gathers each field (no per-step host copy). The shards are read,
verified and transformed once, at start. `train.loader.resident` chooses the path: `auto` on a
CUDA device when the split fits in `train.loader.resident_memory_fraction` of its free memory;
`true` everywhere (on a CPU this runs the same code, so the tests exercise it); `false` never.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from training.data.batch import Batch
from training.data.load.loader import ShardBatches
from training.errors import DataError

__all__ = ["ResidentBatches", "resident_bytes"]

log = logging.getLogger(__name__)


def resident_bytes(batches: ShardBatches) -> int:
    """What the split takes transformed, from its first shard's bytes per row (one shard read)."""
    first = batches._load_shard(0)
    per_row = sum(a.nbytes for a in first.values()) / max(1, first.rows)
    return int(per_row * batches.rows) + 8 * batches.rows  # and an epoch's int64 index


class ResidentBatches:
    """`ShardBatches`' batches from tensors held on `device` (see the module docstring)."""

    def __init__(self, source: ShardBatches, device: torch.device) -> None:
        self.source, self.device = source, device
        self.batch_size, self.rows, self.split = source.batch_size, source.rows, source.split
        self.batches_per_epoch = source.batches_per_epoch
        self.cache_bytes = 0  # no shard cache: the split is held whole
        parts = [source._load_shard(i) for i in range(len(source.shards))]
        keys = set(parts[0])
        for i, part in enumerate(parts):
            if set(part) != keys or any(part[k].shape[1:] != parts[0][k].shape[1:] for k in keys):
                raise DataError(f"shard {source.shards[i].name} of split '{source.split}' holds other fields or "
                                "widths than the first: it cannot be held as one tensor per field")
        self.tensors = {k: torch.from_numpy(np.concatenate([p[k] for p in parts])).to(device) for k in sorted(keys)}
        self.offsets = np.concatenate(([0], np.cumsum([s.rows for s in source.shards])))[:-1]
        self._index: tuple[int, torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def _epoch_index(self, epoch: int) -> torch.Tensor:
        """Every row's place in `epoch`'s order, as `ShardBatches` orders it, on the device."""
        if self._index is None or self._index[0] != epoch:
            src = self.source
            order = src._shard_order(epoch)
            rows = [self.offsets[i] + (src._permutation(epoch, int(i)) if src.shuffle else np.arange(src.shards[i].rows))
                    for i in order]
            index = torch.from_numpy(np.concatenate(rows).astype(np.int64)).to(self.device)
            self._index = (epoch, index)
        return self._index[1]

    def batch(self, epoch: int, index: int) -> Batch:
        lo = index * self.batch_size
        rows = self._epoch_index(epoch)[lo:min(lo + self.batch_size, self.rows)]
        return Batch.of({k: t.index_select(0, rows) for k, t in self.tensors.items()})

    def release(self) -> None:
        """Nothing to drop: the split is the point of holding it."""
