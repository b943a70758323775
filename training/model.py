"""The default model (an MLP over standardised numerics and categorical embeddings), user
model factories, and the content hash of a model's weights."""

from __future__ import annotations

import hashlib
import importlib
from typing import Callable, Mapping

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from training.config import ModelConfig
from training.errors import ConfigError

__all__ = ["TabularMLP", "build_model", "weights_sha256"]


class TabularMLP(nn.Module):
    def __init__(
        self,
        n_numeric: int,
        cardinalities: list[int],
        hidden: list[int],
        embedding_dim: int = 16,
        dropout: float = 0.0,
        gradient_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.embeddings = nn.ModuleList(nn.Embedding(c, embedding_dim) for c in cardinalities)
        width = n_numeric + embedding_dim * len(cardinalities)
        blocks = []
        for h in hidden:
            blocks.append(nn.Sequential(nn.Linear(width, h), nn.ReLU(), nn.Dropout(dropout)))
            width = h
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(width, 1)
        self.gradient_checkpointing = gradient_checkpointing

    def forward(self, x_num: torch.Tensor, x_cat: torch.Tensor) -> torch.Tensor:
        parts = [x_num] + [emb(x_cat[:, j]) for j, emb in enumerate(self.embeddings)]
        x = torch.cat(parts, dim=1)
        for i, block in enumerate(self.blocks):
            # Recompute every other block in backward: about half the activation memory for
            # about a third more compute on those blocks.
            if self.gradient_checkpointing and self.training and i % 2 == 0:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(x).squeeze(-1)


def _load_factory(spec: str) -> Callable[..., nn.Module]:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"model.factory: cannot import module '{module_name}' ({err})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"model.factory: '{module_name}' has no callable '{attr}'")
    return fn


def build_model(config: ModelConfig, n_numeric: int, cardinalities: list[int]) -> nn.Module:
    """The configured model; a user factory is called as fn(n_numeric, cardinalities, config)."""
    if config.factory is None:
        return TabularMLP(
            n_numeric, cardinalities, config.hidden, config.embedding_dim, config.dropout, config.gradient_checkpointing
        )
    model = _load_factory(config.factory)(n_numeric, cardinalities, config)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.factory: '{config.factory}' returned {type(model).__name__}, expected a torch.nn.Module")
    return model


def weights_sha256(state_dict: Mapping[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and raw bytes: equal weights give equal hashes,
    whatever container or file format they were saved in."""
    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
