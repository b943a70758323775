"""The `cuda` tier: the shipped defaults and every GPU path, on a real CUDA GPU. Skipped where
none is visible (`tests/conftest.py`); on a GPU machine, `python -m pytest -m cuda -n 0`.

What the CPU suite cannot show: the default run (piecewise embeddings under deterministic
kernels) validating on CUDA, bf16 chosen and training, fp16 with a GradScaler, a SIGKILL resume
bit-identical under deterministic CUDA kernels, the auto batch size on real CUDA memory with
the end-of-run fp32 re-timing, torch.compile without recompiles, and the text and image
encoders on the GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.training.helpers import assert_resumes_bit_identically_after_a_sigkill, make_job
from tests.training.data.test_text_image import IMAGE, TEXT, _config, digits_source, reviews_source  # noqa: F401
from training.config import RetrainConfig
from training.protocol.results import TrainResult
from training.trainer.run import train

pytestmark = pytest.mark.cuda


def _on_cuda(config: RetrainConfig, **train: object) -> RetrainConfig:
    config.train.device = "cuda"
    for key, value in train.items():
        setattr(config.train, key, value)
    return config


def _trained(config: RetrainConfig, name: str) -> TrainResult:
    result = train(make_job(config, name))
    assert isinstance(result, TrainResult)
    return result


def test_the_default_run_trains_and_validates_on_cuda_in_bf16(small_config: RetrainConfig) -> None:
    """The defaults: piecewise numeric embeddings, deterministic kernels, precision auto."""
    assert small_config.model.numeric_embedding == "piecewise" and small_config.train.deterministic
    result = _trained(_on_cuda(small_config), "default")
    assert result.precision == ("bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16")
    assert result.best_val_auc > 0.7


def test_fp16_trains_with_a_grad_scaler(small_config: RetrainConfig) -> None:
    result = _trained(_on_cuda(small_config, precision="fp16"), "fp16")
    assert result.precision == "fp16" and result.best_val_auc > 0.7


def test_bf16_and_fp32_reach_the_same_quality(small_config: RetrainConfig) -> None:
    bf16 = _trained(_on_cuda(small_config, precision="bf16"), "bf16")
    fp32 = _trained(_on_cuda(small_config, precision="fp32"), "fp32")
    assert abs(bf16.best_val_auc - fp32.best_val_auc) < 0.005


@pytest.mark.slow
def test_a_sigkilled_cuda_run_resumes_bit_identically(small_config: RetrainConfig) -> None:
    small_config.train.max_steps = 60
    assert_resumes_bit_identically_after_a_sigkill(_on_cuda(small_config), kill_at=30)


def test_auto_batch_size_fits_real_cuda_memory_and_the_fp32_retiming_survives(small_config: RetrainConfig) -> None:
    small_config.train.batch_size = 4096
    result = _trained(_on_cuda(small_config, auto_batch_size=True, max_steps=20, measure_fp32=True), "auto-batch")
    assert result.status in ("completed", "early_stopped")
    assert result.precision == "fp32" or (result.fp32_slowdown is not None and result.fp32_slowdown > 0)


def test_compile_trains_on_cuda_without_recompiling(small_config: RetrainConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    from training.trainer.trainer import Trainer

    warmed_up = Trainer._warm_up

    def then_no_recompile(self, compiled):  # type: ignore[no-untyped-def]
        warmed_up(self, compiled)
        monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)

    monkeypatch.setattr(Trainer, "_warm_up", then_no_recompile)
    result = _trained(_on_cuda(small_config, compile=True, max_steps=20), "compiled")
    assert result.compile_seconds is not None and result.compile_seconds > 0


def test_the_text_and_image_encoders_train_on_cuda(tmp_path: Path, digits_source: Path) -> None:  # noqa: F811
    config = _on_cuda(_config(tmp_path, digits_source, [*IMAGE, "data.text=[note]", *TEXT[4:9]]), max_steps=60)
    result = _trained(config, "text-image")
    assert result.best_val_metric is not None


@pytest.mark.parametrize("resident", [True, False])
def test_the_captured_step_replays_the_eager_steps_numbers(resident: bool, small_config: RetrainConfig) -> None:
    """train.step graph on CUDA captures the step (no silent fallback: the report says graph)
    and, under deterministic kernels, ends with the eager run's weights bit for bit."""
    small_config.train.loader.resident = resident
    small_config.model.dropout = 0.1
    eager = _trained(_on_cuda(small_config.model_copy(deep=True), step="eager"), f"eager-{resident}")
    graph = _trained(_on_cuda(small_config.model_copy(deep=True), step="graph"), f"graph-{resident}")
    assert graph.step_mode.step == "graph", graph.step_mode
    assert graph.model.sha256 == eager.model.sha256
