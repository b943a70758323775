"""Capture and restore every RNG that can change a run's future, in a weights_only-safe form."""

from __future__ import annotations

import os
import random
from typing import Any, TypedDict

import numpy as np
import torch

__all__ = ["seed_everything", "configure_determinism", "capture_rng", "restore_rng", "RngState"]


class _CpuRngState(TypedDict):
    python: tuple[Any, ...]  # random.getstate(); a checkpoint may give its tuples back as lists
    numpy: list[Any]  # [kind, keys as an int64 tensor, pos, has_gauss, cached]
    torch: torch.Tensor


class RngState(_CpuRngState, total=False):
    """Every generator's state, as a checkpoint holds it (plain values and tensors only)."""

    cuda: list[torch.Tensor]  # one per GPU the saving machine saw


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def configure_determinism(enabled: bool, device: torch.device) -> None:
    """Deterministic kernels, so a resumed run is bit-identical to an uninterrupted one.

    Only CUDA needs the switch: the CPU kernels the loop uses (matmul, embedding backward,
    AdamW) are deterministic at a fixed thread count, which the resume tests check bit for bit.
    `torch.use_deterministic_algorithms` imports torch._dynamo/_inductor (2.2 s measured on the
    2-core reference machine), which would add to every restart after a preemption.
    """
    if enabled and device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it for determinism
        torch.use_deterministic_algorithms(True, warn_only=False)
        torch.backends.cudnn.benchmark = False


def capture_rng() -> RngState:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: RngState = {
        "python": random.getstate(),
        # numpy's state holds an ndarray, which weights_only loading refuses: store a tensor.
        "numpy": [kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: RngState) -> None:
    random.setstate(_tuples(state["python"]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        # One state per GPU the saving machine saw. A spot retry may land on a machine with
        # fewer (or more) GPUs: restore the ones both have; the others keep their seeded state.
        saved = state["cuda"]
        for index in range(min(len(saved), torch.cuda.device_count())):
            torch.cuda.set_rng_state(saved[index], index)


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
