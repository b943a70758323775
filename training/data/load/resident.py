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
        arrays = {k: np.concatenate([p[k] for p in parts]) for k in sorted(keys)}
        if "tok" in arrays and "ntok" in arrays:
            # Token ids cut once to the split's own longest text: a static shape for the run (a
            # captured step needs one), never max_tokens of padding when no row is that long.
            # The encoder masks padding, so a longer pad changes no row's encoding.
            longest = max(1, int(arrays["ntok"].max(initial=1)))
            arrays["tok"] = np.ascontiguousarray(arrays["tok"][..., :longest])
        self.tensors = {k: torch.from_numpy(a).to(device) for k, a in arrays.items()}
        self.offsets = np.concatenate(([0], np.cumsum([s.rows for s in source.shards])))[:-1]
        self._index: dict[int, torch.Tensor] = {}  # the last two epochs' orders: a block may span both

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def _epoch_index(self, epoch: int) -> torch.Tensor:
        """Every row's place in `epoch`'s order, as `ShardBatches` orders it, on the device."""
        if epoch not in self._index:
            src = self.source
            order = src._shard_order(epoch)
            rows = [self.offsets[i] + (src._permutation(epoch, int(i)) if src.shuffle else np.arange(src.shards[i].rows))
                    for i in order]
            index = torch.from_numpy(np.concatenate(rows).astype(np.int64)).to(self.device)
            self._index = {e: t for e, t in self._index.items() if e == epoch - 1}
            self._index[epoch] = index
        return self._index[epoch]

    def batch(self, epoch: int, index: int) -> Batch:
        lo = index * self.batch_size
        rows = self._epoch_index(epoch)[lo:min(lo + self.batch_size, self.rows)]
        return Batch.of({k: t.index_select(0, rows) for k, t in self.tensors.items()})

    def positions(self, first: int, count: int, per_epoch: int) -> torch.Tensor:
        """The rows of global micro-batches first..first+count-1 (`per_epoch` a epoch), one row
        of the result each, as `batch` gathers them: what a captured step's block reads
        (`training.trainer.step.ResidentInputs`). Device slices, stacked by one kernel."""
        slices = []
        for g in range(first, first + count):
            epoch, index = divmod(g, per_epoch)
            lo = index * self.batch_size
            slices.append(self._epoch_index(epoch)[lo:lo + self.batch_size])
        return torch.stack(slices)

    def release(self) -> None:
        """Nothing to drop: the split is the point of holding it."""
