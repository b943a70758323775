"""Encoders the built-in model composes, one per column kind beyond the tabular ones: a pre-norm
transformer over token ids (text) and a small CNN over pixels (images)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from training.errors import ConfigError

__all__ = ["TextEncoder", "ImageEncoder", "attention_backends"]

_BACKENDS = {"math": "MATH", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION"}


@contextlib.contextmanager
def attention_backends(choice: str) -> Iterator[None]:
    """Force scaled_dot_product_attention's kernel (`auto`: torch's own choice). A kernel the
    device or inputs do not support is a ConfigError naming the setting."""
    if choice == "auto":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        with sdpa_kernel([getattr(SDPBackend, _BACKENDS[choice])]):
            yield
    except RuntimeError as err:
        if "No viable backend" not in str(err):
            raise
        raise ConfigError(f"model.attention={choice}: torch has no such attention kernel for this device and "
                          "dtype (on a CPU: math or flash); set model.attention=auto") from None


class _Block(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x)); stable without warmup tricks."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        # Flash or memory-efficient kernels on a GPU: attention memory linear in the length.
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


def text_length(ntok: torch.Tensor) -> int:
    """Tokens a batch's texts are cut to: the longest text's, rounded up to 16."""
    return -(-int(ntok.max()) // 16) * 16 if ntok.numel() else 16


class TextEncoder(nn.Module):
    """Token ids (batch, texts, max_tokens) and lengths -> one pooled vector per text column."""

    def __init__(self, vocab_size: int, max_tokens: int, dim: int, layers: int, heads: int,
                 attention: str = "auto", gradient_checkpointing: bool = False) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, dim, padding_idx=0)
        self.positions = nn.Embedding(max_tokens, dim)
        self.layers = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.attention = attention
        self.gradient_checkpointing = gradient_checkpointing

    def forward(self, tok: torch.Tensor, ntok: torch.Tensor) -> torch.Tensor:
        b, n_text, t = tok.shape
        lengths = ntok.reshape(b * n_text).long()
        if not torch.compiler.is_compiling() and tok.device.type == "cpu":
            # Attend over the longest text in the batch rounded up to 16, not max_tokens: short
            # texts cost less. On an accelerator the batch comes cut already (`to_device`): the
            # lengths' maximum read here would stall the host on the GPU every step. (Compiled,
            # the length stays fixed: a data-dependent shape would break the graph and recompile.)
            t = min(t, text_length(lengths))
        ids = tok.reshape(b * n_text, -1)[:, :t].long()
        keep = torch.arange(t, device=tok.device)[None, :] < lengths[:, None]  # (rows, t)
        x = self.tokens(ids) + self.positions.weight[:t]
        mask = keep[:, None, None, :]  # every query attends to the real tokens of its text
        with attention_backends(self.attention):
            for block in self.layers:
                if self.gradient_checkpointing and self.training:
                    # Per block: backward keeps one block's input, not its attention and MLP activations.
                    x = checkpoint(block, x, mask, use_reentrant=False)
                else:
                    x = block(x, mask)
        x = self.norm(x)
        weights = keep.to(x.dtype)[:, :, None]
        pooled = (x * weights).sum(dim=1) / weights.sum(dim=1)  # the mean over real tokens
        return pooled.reshape(b, n_text * x.shape[-1])


class ImageEncoder(nn.Module):
    """uint8 pixels (batch, images, 3, size, size) -> one vector per image column. Normalised
    here, per channel with the train mean and std, so the stored pixels stay uint8."""

    def __init__(self, channels: list[int], mean: list[float], std: list[float]) -> None:
        super().__init__()
        self.mean: torch.Tensor
        self.std: torch.Tensor
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1))
        blocks: list[nn.Module] = []
        width = 3
        for c in channels:
            blocks += [nn.Conv2d(width, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, ceil_mode=True)]
            width = c
        self.convs = nn.Sequential(*blocks)
        self.width = width

    def forward(self, pix: torch.Tensor) -> torch.Tensor:
        b, n_img = pix.shape[:2]
        x = (pix.reshape(b * n_img, *pix.shape[2:]).float() - self.mean) / self.std
        x = self.convs(x).mean(dim=(2, 3))
        return x.reshape(b, n_img * self.width)
