"""The device type and precision a run's config means on a machine, as its run key records them:
the rules, torch-free, and the two facts only torch knows (is a CUDA GPU usable, has it native
bf16), asked of torch only where a GPU driver is present. The launcher keys runs with it; the
training process checks its own numerics against the key, and the trainer applies the same rules
(`training.trainer.precision`)."""

from __future__ import annotations

import functools
import os
import shutil
import statistics
import subprocess
import sys
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from training.config import RetrainConfig
from training.errors import ConfigError

__all__ = ["PrecisionPick", "device_for", "gpu_driver_present", "gpu_facts", "gpu_name", "job_numerics", "pick_precision",
           "precision_for", "resolved_numerics"]

# An NVIDIA driver (CUDA) or AMD's kernel driver (ROCm, which torch also calls cuda): without
# either, torch sees no GPU.
_GPU_DRIVER_FILES = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd")


def gpu_driver_present() -> bool:
    return any(os.path.exists(path) for path in _GPU_DRIVER_FILES)


def device_for(requested: str, cuda_available: bool) -> str:
    """The device type `train.device` means where a CUDA GPU is (or is not) usable."""
    if requested == "cuda" and not cuda_available:
        raise ConfigError("train.device=cuda but no CUDA GPU is visible; set train.device=auto or cpu")
    if requested == "auto":
        return "cuda" if cuda_available else "cpu"
    return requested


def precision_for(requested: str, device_type: str, bf16_native: bool) -> str:
    """auto: bf16 on CUDA GPUs with native bf16, fp16 on older GPUs, fp32 on CPU.

    fp32 on CPU because bf16 autocast on a CPU without native bf16 (AVX2-only) measured about
    4x slower than fp32 on the 2-core reference machine. Native bf16 only (compute capability
    8.0 on: A100, L4, H100): on T4 and V100, which emulate it, fp16 with a GradScaler runs on the
    tensor cores, and `retrain plan` prices those GPUs in fp16.
    """
    if requested == "fp16" and device_type != "cuda":
        raise ConfigError("train.precision=fp16 needs a CUDA GPU; use bf16 or fp32 on CPU")
    if requested != "auto":
        return requested
    if device_type == "cuda":
        return "bf16" if bf16_native else "fp16"
    return "fp32"


def resolved_numerics(device: str, precision: str) -> tuple[str, str]:
    """(device type, precision) that `train.device` and `train.precision` mean on this machine:
    part of what a run computes, so part of its run key. On a machine with no GPU driver the
    answer is the CPU's; elsewhere nvidia-smi says whether a GPU is usable and whether it has
    native bf16 (`gpu_facts`). Never torch in this process: a parent that starts CUDA holds GPU
    memory for its life, and a child forked from it could not use CUDA at all."""
    if device == "cpu" or (device == "auto" and not gpu_driver_present()):
        return "cpu", precision_for(precision, "cpu", False)
    usable, native = gpu_facts()
    device_type = device_for(device, usable)
    return device_type, precision_for(precision, device_type, device_type == "cuda" and native)


@functools.lru_cache(maxsize=1)
def gpu_facts() -> tuple[bool, bool]:
    """(a CUDA GPU is usable, it has native bf16: compute capability 8.0 or later), for the first
    GPU this process may use (CUDA_VISIBLE_DEVICES), from nvidia-smi; where it cannot say (AMD's
    ROCm, no nvidia-smi), from torch in a child process, which is then gone with its CUDA state."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False, False
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        first = (visible or "0").split(",")[0].strip()
        try:
            out = subprocess.run([smi, "-i", first, "--query-gpu=compute_cap", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30, check=True).stdout.strip()
            return True, float(out.splitlines()[0]) >= 8.0
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            pass  # an old driver without compute_cap: ask torch, in a child
    probe = ("import torch; a = torch.cuda.is_available(); "
             "print(int(a), int(a and torch.cuda.is_bf16_supported(including_emulation=False)))")
    try:
        said = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                              check=True).stdout.split()
        return said[-2] == "1", said[-1] == "1"
    except (OSError, subprocess.SubprocessError, IndexError):
        return False, False


def job_numerics(config: RetrainConfig) -> tuple[str, str]:
    """(device type, precision) the run's training processes will use: this machine's, except
    for nodes on Kubernetes, which are not this machine (the launcher often has no GPU): there
    the nodes' declared GPUs decide, with the precision the config names (checked explicit)."""
    d, tc = config.train.distributed, config.train
    if d.nnodes > 1 and d.scheduler == "kubernetes":
        if d.kubernetes.gpu == 0 or tc.device == "cpu":
            return "cpu", "fp32" if tc.precision == "auto" else tc.precision
        return "cuda", tc.precision
    return resolved_numerics(tc.device, tc.precision)


class PrecisionPick(BaseModel):
    """What `train.precision: auto` measured on a GPU, and chose. Stored under the storage root
    (`training.pipeline.precision_pick`), where others write: only these keys, each checked."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    precision: Literal["fp32", "bf16"]
    gpu: str = Field(max_length=200)
    fp32_seconds: list[float] = Field(min_length=1, max_length=20)  # per step, one figure a round
    bf16_seconds: list[float] = Field(min_length=1, max_length=20)


# bf16 must beat fp32 by this much at least, and by more than fp32's own spread over rounds:
# fp32's numerics are the simpler ones, so it is the default a measurement has to overturn.
MIN_GAIN = 0.05


def pick_precision(times: dict[str, list[float]], gpu: str) -> PrecisionPick:
    """fp32 unless bf16 is faster beyond the noise of the measurement (see MIN_GAIN)."""
    fp32, bf16 = times["fp32"], times["bf16"]
    m32, m16 = statistics.median(fp32), statistics.median(bf16)
    noise = (max(fp32) - min(fp32)) / m32 if m32 > 0 else 1.0
    faster = m16 < m32 * (1 - max(MIN_GAIN, noise))
    return PrecisionPick(precision="bf16" if faster else "fp32", gpu=gpu, fp32_seconds=fp32, bf16_seconds=bf16)


def gpu_name() -> str:
    """The first GPU's name, from nvidia-smi (never by starting CUDA in this process); "unknown"
    where it cannot say."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "unknown"
    try:
        out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (out.strip().splitlines() or ["unknown"])[0][:200]
