"""Every categorical column is looked up in one kernel, with the numbers, gradients and state
dict of a lookup per column: packages and checkpoints written before it load, and a run trains
what it trained."""

from __future__ import annotations

import copy
import types

import torch

from training.data.batch import Batch
from training.model.network import ColumnsNet, ModelSchema


def _per_column(self: ColumnsNet, x_cat: torch.Tensor) -> torch.Tensor:
    return torch.cat([emb(x_cat[:, j]) for j, emb in enumerate(self.embeddings)], 1)


def test_one_lookup_trains_what_a_lookup_per_column_trains() -> None:
    torch.manual_seed(0)
    schema = ModelSchema("binary", 1, ["a"], ["x", "y", "z"], [5, 7, 300], numeric_bins=[[-1.0, 0.0, 1.0]])
    model = ColumnsNet(schema, [32], 8)
    reference = copy.deepcopy(model)
    reference._embed = types.MethodType(_per_column, reference)  # type: ignore[method-assign]
    for _ in range(5):
        rows = 64
        batch = Batch(num=torch.randn(rows, 1), label=torch.randint(0, 2, (rows,)).float(),
                      cat=torch.stack([torch.randint(0, c, (rows,)) for c in (5, 7, 300)], 1))
        for m in (model, reference):
            m.zero_grad()
            m(batch).pow(2).mean().backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad  # type: ignore[operator]
    assert list(model.state_dict()) == list(reference.state_dict())  # one table per column, as before
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values(),
                                                 strict=True))
    fresh = ColumnsNet(schema, [32], 8)
    fresh.load_state_dict(reference.state_dict())  # strict: the stacking offsets are not state
    assert torch.equal(fresh(batch), reference(batch))
