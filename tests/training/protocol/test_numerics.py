"""The run key's device and precision, decided without torch (nvidia-smi where a GPU driver is
present), are those torch decides."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from training.errors import ConfigError
from training.protocol import numerics
from training.trainer import precision


@pytest.mark.parametrize("device", ["auto", "cpu"])
@pytest.mark.parametrize("requested", ["auto", "fp32", "bf16"])
def test_without_a_gpu_driver_the_answer_is_torchs(device: str, requested: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(numerics, "gpu_driver_present", lambda: False)
    torch_device = precision.resolve_device(device)
    assert numerics.resolved_numerics(device, requested) == (torch_device.type,
                                                             precision.resolve_precision(requested, torch_device))


def test_fp16_without_a_gpu_is_the_same_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(numerics, "gpu_driver_present", lambda: False)
    with pytest.raises(ConfigError, match="fp16 needs a CUDA GPU"):
        numerics.resolved_numerics("auto", "fp16")
    with pytest.raises(ConfigError, match="fp16 needs a CUDA GPU"):
        precision.resolve_precision("fp16", precision.resolve_device("cpu"))


def _nvidia_smi(folder: Path, compute_cap: str) -> None:
    """A stand-in nvidia-smi on PATH that answers the compute capability query."""
    script = folder / "nvidia-smi"
    script.write_text(f"#!/bin/sh\necho {compute_cap}\n")
    script.chmod(0o755)


@pytest.mark.parametrize(("compute_cap", "precision_auto"), [("9.0", "bf16"), ("8.0", "bf16"), ("7.5", "fp16")])
def test_with_a_gpu_driver_nvidia_smi_is_asked_never_torch(compute_cap: str, precision_auto: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent never starts CUDA: an H100 (9.0) and an A100 (8.0) have native bf16, a T4 (7.5)
    runs fp16. Torch is not asked (its import would fail here)."""
    _nvidia_smi(tmp_path, compute_cap)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(numerics, "gpu_driver_present", lambda: True)
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises
    numerics.gpu_facts.cache_clear()
    try:
        assert numerics.resolved_numerics("auto", "auto") == ("cuda", precision_auto)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # a driver, no GPU for this process
        numerics.gpu_facts.cache_clear()
        assert numerics.resolved_numerics("auto", "auto") == ("cpu", "fp32")
        with pytest.raises(ConfigError, match="no CUDA GPU is visible"):
            numerics.resolved_numerics("cuda", "auto")
    finally:
        numerics.gpu_facts.cache_clear()
