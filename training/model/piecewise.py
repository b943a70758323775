"""Piecewise-linear numeric embeddings (rtdl-num-embeddings' `PiecewiseLinearEmbeddings`,
version B), with a faster path where no gradient is wanted.

rtdl encodes every value against every bin of its column, a (batch, columns, bins) tensor, and
multiplies that by a (bins, width) matrix per column. Over 8,192 rows of the demo's six
numerics, that was 20 of a forward's 33 ms on one CPU thread (torch's profiler). The encoding is 1 on the bins below the value's,
its position within its own bin, and 0 above, so the product is the sum of the matrix rows of
the bins below plus the position times its own bin's row: a running sum looked up by the
value's bin. Validation, evaluation and scoring (no gradient) take that path; training keeps
rtdl's, whose backward is its own. The two agree to float rounding (`tests/training/
model/test_numeric_embeddings.py`); parameters and state-dict keys are rtdl's.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import torch
from torch import Tensor

__all__ = ["PeriodicEmbeddings", "PiecewiseLinear", "without_sklearn_tree"]


@contextlib.contextmanager
def without_sklearn_tree() -> Iterator[None]:
    """Import `rtdl_num_embeddings` in this block, without scikit-learn. rtdl imports
    `sklearn.tree` when it can, for tree-based bins this project does not use (its bins are
    preprocessing's quantiles), and that import added 2 to 3 s to every scoring command and
    training process (`python -c "import torch"` against `"import torch, sklearn.tree"`). A
    None entry in sys.modules makes that import fail, which rtdl handles; the entry is removed
    afterwards, so the rest of the process imports scikit-learn as usual."""
    if "rtdl_num_embeddings" in sys.modules or "sklearn.tree" in sys.modules:
        yield
        return
    sys.modules["sklearn.tree"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        del sys.modules["sklearn.tree"]


with without_sklearn_tree():
    from rtdl_num_embeddings import PeriodicEmbeddings, PiecewiseLinearEmbeddings


class PiecewiseLinear(PiecewiseLinearEmbeddings):
    """`PiecewiseLinearEmbeddings(bins, width, activation=False, version="B")`."""

    def __init__(self, bins: list[Tensor], width: int) -> None:
        super().__init__(bins, width, activation=False, version="B")
        n_bins = [len(edges) - 1 for edges in bins]
        most = max(n_bins)
        # Where rtdl keeps bin k of a column: the first n-1 bins lead, the last bin is always in
        # the last place (see `_PiecewiseLinearEncodingImpl`). A padding bin points at the last
        # place too; the lookup never selects it.
        position = torch.full((len(bins), most), most - 1, dtype=torch.long)
        inner = torch.full((len(bins), max(most - 1, 1)), float("inf"))
        for f, (edges, n) in enumerate(zip(bins, n_bins, strict=True)):
            position[f, :n - 1] = torch.arange(n - 1)
            inner[f, :n - 1] = edges[1:-1].float()
        # Derived from the bins, so not part of the state dict: packages keep rtdl's keys.
        self.register_buffer("_position", position, persistent=False)
        self.register_buffer("_inner_edges", inner, persistent=False)
        self.register_buffer("_strictly_below", torch.ones(most, most).tril(-1), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled() or x.ndim != 2:
            return super().forward(x)
        return self._by_bin(x)

    def _by_bin(self, x: Tensor) -> Tensor:
        n_cols = x.shape[1]
        position = self._position
        # The bin of each value: how many inner edges lie at or below it. Below the first edge
        # it is bin 0 and above the last the last bin, each extrapolated, as rtdl's clamps do.
        column_major = x.t().contiguous()
        bin_of = torch.searchsorted(self._inner_edges, column_major, right=True)  # (columns, rows)
        place = position.gather(1, bin_of)
        # Within its bin: the encoding's own affine map, as rtdl computes it.
        scale, shift = self.impl.weight.gather(1, place), self.impl.bias.gather(1, place)
        within = torch.addcmul(shift, scale, column_major).t()  # (rows, columns)
        rows = self.linear.weight.gather(1, position[..., None].expand(-1, -1, self.linear.weight.shape[2]))
        # (columns, bins, width): the sum of the rows of the bins below each bin, as a product with
        # a strictly lower-triangular matrix of ones. Not cumsum: a floating cumsum on CUDA is
        # nondeterministic and raises under `torch.use_deterministic_algorithms` (train.deterministic).
        below = torch.matmul(self._strictly_below.to(rows.dtype), rows)
        flat = (bin_of + torch.arange(n_cols, device=x.device)[:, None] * position.shape[1]).t()  # (rows, columns)
        width = rows.shape[2]
        out = torch.nn.functional.embedding(flat, below.reshape(-1, width))
        out = out.addcmul_(within[..., None], torch.nn.functional.embedding(flat, rows.reshape(-1, width)))
        assert self.linear0 is not None  # version B
        return out.add_(self.linear0(x))
