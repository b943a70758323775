"""Rows as a shard stores them: what validation encodes from a source's record batch, what
packing writes as one tar member per array, and what every reader of a shard gets back.

A block of rows is stored as `<key>.<member>.npy` files, the members in this order: `num`
(float32 raw numbers, NaN for null), `cat` (int64 value hashes), `label`, then `vec` (vector
columns side by side) where the data has vector columns, a ragged `text<j>` and `image<j>` per
text and image column (values and `<member>_offsets`, see `training.data.ingest.ragged`), and
`row` (each row's source row) where it has image columns. The member names are the file
format; `StoredRows` is the one place that reads or writes them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace

import numpy as np

from training.data.batch import Columns
from training.data.ingest.ragged import OFFSETS, Ragged, Rows

__all__ = ["StoredRows", "UnknownMembers"]

_RAGGED = re.compile(r"^(text|image)(\d+)$")


class UnknownMembers(ValueError):
    """A block whose members are not those of the format (the reader names the shard)."""


@dataclass(frozen=True)
class StoredRows:
    """One block of rows in the stored encoding (before preprocessing's transform)."""

    num: np.ndarray
    cat: np.ndarray
    label: np.ndarray | None = None  # absent from rows being scored
    vec: np.ndarray | None = None
    texts: tuple[Ragged, ...] = ()
    images: tuple[Ragged, ...] = ()
    row: np.ndarray | None = None

    @property
    def rows(self) -> int:
        return len(self.num)

    def members(self) -> Iterator[tuple[str, Rows]]:
        """(member name, values) in the order a shard stores them."""
        yield "num", self.num
        yield "cat", self.cat
        if self.label is not None:
            yield "label", self.label
        if self.vec is not None:
            yield "vec", self.vec
        for j, text in enumerate(self.texts):
            yield f"text{j}", text
        for j, image in enumerate(self.images):
            yield f"image{j}", image
        if self.row is not None:
            yield "row", self.row

    @classmethod
    def from_members(cls, arrays: Mapping[str, np.ndarray]) -> StoredRows:
        """The rows of a block read from a shard, its arrays by member name (ragged ones as
        values and offsets); an UnknownMembers for members the format has not."""
        fixed: dict[str, np.ndarray] = {}
        ragged: dict[str, list[tuple[int, Ragged]]] = {"text": [], "image": []}
        for name, values in arrays.items():
            if name.endswith(OFFSETS):
                continue
            found = _RAGGED.match(name)
            if found is not None and name + OFFSETS in arrays:
                ragged[found.group(1)].append((int(found.group(2)), Ragged(values, arrays[name + OFFSETS].astype(np.int64, copy=False))))
            elif name in ("num", "cat", "label", "vec", "row"):
                fixed[name] = values
            else:
                raise UnknownMembers(f"member '{name}' is not one a shard holds")
        if "num" not in fixed or "cat" not in fixed:
            raise UnknownMembers("it has no 'num' or 'cat' member")
        texts, images = (tuple(r for _, r in sorted(ragged[kind], key=lambda jr: jr[0])) for kind in ("text", "image"))
        return cls(texts=texts, images=images, **fixed)

    def with_label(self, label: np.ndarray) -> StoredRows:
        return replace(self, label=label)

    def prepared(self) -> Columns:
        """The members the model takes as they are stored (num and cat are then transformed)."""
        return Columns(num=self.num, cat=self.cat, label=self.label, vec=self.vec)

    def take(self, order: np.ndarray) -> StoredRows:
        """The rows in `order`."""
        return self._each(lambda v: np.take(v, order, axis=0), lambda r: r.take(order))

    def slice(self, start: int, stop: int) -> StoredRows:
        return self._each(lambda v: v[start:stop], lambda r: r[start:stop])

    @staticmethod
    def concat(parts: list[StoredRows]) -> StoredRows:
        """The parts' rows one after another (all with the same members)."""
        if len(parts) == 1:
            return parts[0]
        return StoredRows(
            num=np.concatenate([p.num for p in parts]), cat=np.concatenate([p.cat for p in parts]),
            label=_concat([p.label for p in parts]), vec=_concat([p.vec for p in parts]),
            row=_concat([p.row for p in parts]),
            texts=tuple(Ragged.concat(texts) for texts in zip(*(p.texts for p in parts), strict=True)),
            images=tuple(Ragged.concat(images) for images in zip(*(p.images for p in parts), strict=True)))

    def _each(self, arrays: Callable[[np.ndarray], np.ndarray], ragged: Callable[[Ragged], Ragged]) -> StoredRows:
        return StoredRows(
            num=arrays(self.num), cat=arrays(self.cat), label=None if self.label is None else arrays(self.label),
            vec=None if self.vec is None else arrays(self.vec), row=None if self.row is None else arrays(self.row),
            texts=tuple(map(ragged, self.texts)), images=tuple(map(ragged, self.images)))


def _concat(parts: list[np.ndarray | None]) -> np.ndarray | None:
    present = [p for p in parts if p is not None]
    return np.concatenate(present) if present else None
