"""One batch's rows, by column group: the arrays preprocessing hands the loader, and the tensors
the loader hands the model. The one place their keys are named.

- `num`: float32 [rows, numeric columns], standardised (or piecewise-encoded) numbers;
- `cat`: int64 [rows, categorical columns], vocabulary indices (0 = unknown);
- `label`: the label as the task trains on it (float32 binary or regression, int64 class index);
- `vec`: float32 [rows, width], fixed-width vector columns side by side;
- `tok`: int32 [rows, text columns, tokens], token ids (0 = padding); `ntok`: int32 [rows, text
  columns], how many of them are real;
- `pix`: uint8 [rows, images, height, width, 3], decoded pixels;
- `row`: int64 [rows], each row's index in its split (the order scoring writes back).

`Batch` types them as tensors; `Arrays` holds them as numpy arrays by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping, TypedDict, cast

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["Arrays", "Batch", "batch_of", "columns", "map_batch"]

# A shard's or a batch's columns as numpy arrays, by name: the groups above, and as stored in a
# shard before preprocessing also `text{j}` and `image{j}` (ragged bytes), so not a TypedDict.
Arrays = dict[str, np.ndarray]


class Batch(TypedDict, total=False):
    """One batch's columns as tensors, on the host or on the training device."""

    num: torch.Tensor
    cat: torch.Tensor
    label: torch.Tensor
    vec: torch.Tensor
    tok: torch.Tensor
    ntok: torch.Tensor
    pix: torch.Tensor
    row: torch.Tensor


# The loader, the transform and the trainer move every group the same way (to the device,
# pinned, sliced, gathered by row) by looping over the groups a batch has: these are the two
# views between a batch and its groups by name. No copy, no check: a TypedDict is a dict.
def columns(batch: Batch) -> dict[str, torch.Tensor]:
    """A batch's groups by name, for code that treats every group alike."""
    return cast("dict[str, torch.Tensor]", batch)


def batch_of(groups: Mapping[str, torch.Tensor]) -> Batch:
    """The batch whose groups these are (keys among Batch's)."""
    return cast(Batch, groups)


def map_batch(batch: Batch, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
    """`fn` applied to every group of the batch (to a device, a slice of rows, a gather)."""
    return batch_of({k: fn(v) for k, v in columns(batch).items()})
