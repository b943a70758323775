"""The run key's device and precision, decided without torch where no GPU driver is present,
are those torch decides."""

from __future__ import annotations

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


def test_with_a_gpu_driver_torch_is_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(numerics, "gpu_driver_present", lambda: True)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # a driver, but no usable GPU
    assert numerics.resolved_numerics("auto", "auto") == ("cpu", "fp32")
    with pytest.raises(ConfigError, match="no CUDA GPU is visible"):
        numerics.resolved_numerics("cuda", "auto")
