"""The device type and precision a run's config means on this machine, as its run key records
them, decided in the flow's process without importing torch where that is possible."""

from __future__ import annotations

import os

from training.config import RetrainConfig
from training.errors import ConfigError

__all__ = ["gpu_driver_present", "job_numerics", "resolved_numerics"]

# An NVIDIA driver (CUDA) or AMD's kernel driver (ROCm, which torch also calls cuda): without
# either, torch sees no GPU.
_GPU_DRIVER_FILES = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd")


def gpu_driver_present() -> bool:
    return any(os.path.exists(path) for path in _GPU_DRIVER_FILES)


def resolved_numerics(device: str, precision: str) -> tuple[str, str]:
    """(device type, precision) that `train.device` and `train.precision` mean on this machine:
    part of what a run computes, so part of its run key. On a machine with no GPU driver the
    answer is the CPU's, known without torch; elsewhere torch is asked (which GPU, and whether
    it has native bf16)."""
    if device == "cpu" or (device == "auto" and not gpu_driver_present()):
        if precision == "fp16":
            raise ConfigError("train.precision=fp16 needs a CUDA GPU; use bf16 or fp32 on CPU")
        return "cpu", "fp32" if precision == "auto" else precision
    from training.trainer import precision as torch_side

    return torch_side.resolved_numerics(device, precision)


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
