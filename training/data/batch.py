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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["BATCH_KEYS", "Arrays", "Batch", "BatchKey"]

BatchKey = Literal["num", "cat", "label", "vec", "tok", "ntok", "pix", "row"]
BATCH_KEYS: tuple[BatchKey, ...] = ("num", "cat", "label", "vec", "tok", "ntok", "pix", "row")

# Mappings by column group, not TypedDicts: the loader, the transform and the trainer move every
# group the same way (to the device, pinned, gathered by row), by looping over the keys a batch
# has, which a TypedDict would make a cast at each loop.
Arrays = dict[str, np.ndarray]  # one batch's columns as numpy arrays (preprocessing, the loader's cache)
Batch = dict[str, "torch.Tensor"]  # one batch's columns as tensors, on the host or the training device
