"""Will the configured model fit in this machine's memory? Checked before training starts, so a
model too large to allocate is one clear ConfigError naming the keys to change, not an
allocator failure (or the OOM killer) in the middle of the first step.

The model is built on PyTorch's `meta` device: every parameter's shape and dtype, no storage.
Training holds each fp32 parameter four times (weights, gradients, AdamW's two moments) plus the
activations a step keeps for backward, estimated from the micro-batch and the layer widths.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from training.config import RetrainConfig
from training.errors import ConfigError
from training.model.network import ModelSchema
from training.model.spec import build_model

__all__ = ["available_bytes", "training_bytes", "training_need", "check_model_fits", "check_space_fits"]

# Weights, gradients and AdamW's exp_avg and exp_avg_sq, each as large as the weights.
_COPIES_PER_PARAMETER = 4
# Left to the rest of the process: torch itself, the loader's shards, the interpreter.
_HEADROOM = 0.8


def _cgroup_room() -> int | None:
    """Bytes the container's memory limit still allows (cgroup v2, then v1), or None."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # "max", or v1's "no limit" near 2^63
            return max(0, int(limit) - usage)
    return None


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_bytes(device: torch.device) -> int | None:
    """Memory a training process on `device` can still allocate; None where it cannot be told."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    found = [b for b in (_mem_available(), _cgroup_room()) if b is not None]
    if not found and hasattr(os, "sysconf"):
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError):
            pass
    return min(found) if found else None


def training_bytes(model: torch.nn.Module, batch_rows: int, widths: list[int]) -> tuple[int, int]:
    """(parameters, bytes a training step holds) of a model built on the meta device."""
    params = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    activations = batch_rows * sum(widths) * 4 * 2  # kept for backward, and their gradients
    return params, param_bytes * _COPIES_PER_PARAMETER + activations


def training_need(config: RetrainConfig, schema: ModelSchema) -> tuple[int, int]:
    """(parameters, bytes) of training `config`'s built-in model."""
    with torch.device("meta"):
        model = build_model(config.model, schema)
    rows = config.train.batch_size // config.train.world_size
    return training_bytes(model, rows, list(config.model.hidden))


def check_model_fits(config: RetrainConfig, schema: ModelSchema, device: torch.device,
                     keys: str = "model.hidden, model.embedding_dim or preprocess.max_vocab") -> None:
    """Raise ConfigError when training `config`'s built-in model would not fit in `device`'s
    memory. A user factory's model is not built twice (its code may load weights): an
    allocation failure while building it is reported instead (`build_model`)."""
    if config.model.factory is not None:
        return
    available = available_bytes(device)
    if available is None:
        return
    params, needed = training_need(config, schema)
    if needed > available * _HEADROOM:
        raise ConfigError(
            f"the model does not fit in memory: {params:,} parameters need about {needed / 1e9:.1f} GB to train "
            f"(weights, gradients and optimizer state at batch {config.train.batch_size // config.train.world_size}) "
            f"and {device.type} has {available / 1e9:.1f} GB free; lower {keys} (model.hidden is {config.model.hidden})")


def check_space_fits(config: RetrainConfig, schema: ModelSchema, device: torch.device) -> None:
    """Every trial of `tune.space` must fit: each dimension at each of its extremes, and the
    largest extreme of every dimension together. A ConfigError names the key to narrow."""
    from training.search_space import parse_space

    if config.model.factory is not None:
        return
    largest: dict[str, object] = {}
    for dim in parse_space(config.tune.space):
        sized = []
        for value in dim.extremes():
            trial = config.with_values({dim.key: value}, "(tuning trial)")
            check_model_fits(trial, schema, device, keys=f"tune.space.{dim.key} (its value {value!r})")
            sized.append((training_need(trial, schema)[1], value))
        largest[dim.key] = max(sized, key=lambda pair: pair[0])[1]
    if len(largest) > 1:
        check_model_fits(config.with_values(largest, "(tuning trial)"), schema, device,
                         keys=f"the largest values of tune.space together ({largest})")
