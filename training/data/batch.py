"""One batch's rows, by column group: the arrays preprocessing hands the loader, and the tensors
the loader hands the model. The one place the groups are named.

- `num`: float32 [rows, numeric columns], standardised (or piecewise-encoded) numbers;
- `cat`: int64 [rows, categorical columns], vocabulary indices (0 = unknown);
- `label`: the label as the task trains on it (float32 binary or regression, int64 class index);
  absent from data being scored;
- `vec`: float32 [rows, width], fixed-width vector columns side by side;
- `tok`: int32 [rows, text columns, tokens], token ids (0 = padding); `ntok`: int32 [rows, text
  columns], how many of them are real;
- `pix`: uint8 [rows, images, height, width, 3], decoded pixels;
- `row`: int64 [rows], each row's index in its split (the order scoring writes back).

`Groups` holds them, typed by what they are: `Batch` as tensors, `Columns` as numpy arrays. The
code reads a group as an attribute (`batch.num`); a user's model may also read it by name
(`batch["num"]`, `"tok" in batch`), since a `Groups` is a read-only mapping of the groups it has.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["GROUPS", "Batch", "Columns", "Groups", "MissingGroup", "present"]

GROUPS = ("num", "cat", "label", "vec", "tok", "ntok", "pix", "row")

T = TypeVar("T", np.ndarray, "torch.Tensor")
U = TypeVar("U", np.ndarray, "torch.Tensor")
V = TypeVar("V")


class MissingGroup(KeyError):
    """A batch without a group its reader needs: a bug in whoever built the batch."""


def present(value: V | None, group: str) -> V:
    """`value`, a group a batch must have here (a training batch's label, the text model's tokens)."""
    if value is None:
        raise MissingGroup(f"the batch has no '{group}' group")
    return value


# Frozen and slotted: a batch is built once per step and only read after. eq=False: equality of
# arrays is elementwise, so a batch has none (Mapping's would raise on its first group).
@dataclass(frozen=True, slots=True, eq=False)
class Groups(Mapping[str, T], Generic[T]):
    """One batch's (or shard's) column groups; the optional ones are None where the data has none."""

    num: T
    cat: T
    label: T | None = None
    vec: T | None = None
    tok: T | None = None
    ntok: T | None = None
    pix: T | None = None
    row: T | None = None

    @classmethod
    def of(cls, groups: Mapping[str, T]) -> Groups[T]:
        """The groups of a mapping by name (keys among `GROUPS`: a shard's stored arrays)."""
        unknown = groups.keys() - set(GROUPS)
        if unknown:
            raise KeyError(f"not a batch group: {sorted(unknown)}")
        return cls(**groups)

    @property
    def rows(self) -> int:
        return len(self.num)

    def map(self, fn: Callable[[T], U]) -> Groups[U]:
        """`fn` applied to every group (to a device, a slice of rows, a gather, numpy to torch)."""
        # Once per batch in the loader: the fields read directly, not through Mapping's views.
        return Groups(**{name: fn(value) for name in GROUPS if (value := getattr(self, name)) is not None})

    def slice(self, start: int, stop: int) -> Groups[T]:
        """Rows `start` to `stop` of every group (views, not copies)."""
        return self.map(lambda v: v[start:stop])

    def replace(self, **groups: T) -> Groups[T]:
        return Groups(**{**dict(self.items()), **groups})

    def __getitem__(self, name: str) -> T:
        value = getattr(self, name, None) if name in GROUPS else None
        if value is None:
            raise KeyError(name)
        return value

    def __iter__(self) -> Iterator[str]:
        return (name for name in GROUPS if getattr(self, name) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


Batch = Groups["torch.Tensor"]
Columns = Groups[np.ndarray]
