"""The CUDA-only paths of training, checked on the CPU where a check can fail here: the device
each tensor lives on (the `meta` device, or a recorded call), and the choices made from what a
GPU reports (patched). The same paths run for real in the `cuda` tier (tests/cuda)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from training.data.prepare.features import FeatureStats
from training.model.network import to_device
from training.model.target_transform import LabelTransform
from training.trainer.precision import measure_fp32_slowdown, resolve_precision
from training.trainer.rng import capture_rng, restore_rng
from training.trainer.stopping import agree_across_ranks
from training.trainer.throughput import cuda_memory_budget
from training.data.batch import Batch


class _Reduced(Exception):
    pass


def test_the_stop_agreement_flags_live_on_the_training_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """nccl all-reduces CUDA tensors only: a CPU tensor there fails every multi-GPU run after step 1."""
    seen: list[torch.device] = []

    def all_reduce(tensor: torch.Tensor, op: object = None) -> None:
        seen.append(tensor.device)
        raise _Reduced

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    with pytest.raises(_Reduced):
        agree_across_ranks(False, "completed", True, 0, torch.device("meta"))
    assert seen == [torch.device("meta")]


def test_the_stop_agreement_returns_rank_zeros_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, op=None: None)
    assert agree_across_ranks(True, "early_stopped", True, 0, torch.device("cpu"), 4) == (True, "early_stopped", True, 4)
    assert agree_across_ranks(False, "early_stopped", True, 1, torch.device("cpu"), 8) == (False, "completed", False, 0)


def test_a_checkpoint_from_more_gpus_restores_on_fewer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A spot retry may land on a machine with 1 GPU where the checkpoint saw 8."""
    restored: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append(int(device)))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [torch.zeros(16, dtype=torch.uint8)] * 8)
    state = capture_rng()
    assert len(state["cuda"]) == 8
    restore_rng(state)
    assert restored == [0]


@pytest.mark.parametrize(("native", "chosen"), [(True, "bf16"), (False, "fp16")])
def test_auto_precision_takes_bf16_only_where_the_gpu_has_it_natively(monkeypatch: pytest.MonkeyPatch,
                                                                     native: bool, chosen: str) -> None:
    """torch counts emulated bf16 (T4, V100) as supported unless asked not to; there fp16 with a
    GradScaler uses the tensor cores, and the planner prices those GPUs in fp16."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native or including_emulation)
    assert resolve_precision("auto", torch.device("cuda")) == chosen


def test_the_quantile_target_follows_the_labels_device() -> None:
    """The task keeps its label transform outside the model: `model.to("cuda")` never moves the
    knots, so the loss must take them to the label's device."""
    y = np.random.default_rng(0).lognormal(3, 1, 1000)
    knots = np.quantile(y, np.linspace(0, 1, 33)).tolist()
    stats = FeatureStats([], [], [], [], [], task="regression", label_mean=0.0, label_std=1.0,
                         target_transform="quantile", target_knots=knots)
    transform = LabelTransform(stats)
    on_meta = transform.target(torch.tensor(y[:8], dtype=torch.float32, device="meta"))
    assert on_meta.device.type == "meta" and on_meta.shape == (8,)


class _OutOfMemoryAbove:
    """A task whose step needs more memory than there is above `rows` rows."""

    def __init__(self, rows: int) -> None:
        self.rows, self.tried = rows, []  # type: ignore[var-annotated]

    def forward_loss(self, forward, batch, device, dtype):  # type: ignore[no-untyped-def]
        n = batch.rows
        self.tried.append(n)
        if n > self.rows:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return forward(batch.num).float().mean()


def test_the_fp32_retiming_after_training_never_fails_the_run_for_memory() -> None:
    """A bf16 micro-batch sized to fill the GPU does not fit in fp32: the re-timing halves its
    rows until it fits, and reports no slowdown when nothing fits."""
    model = torch.nn.Linear(4, 1)
    batch = Batch(num=torch.randn(64, 4), cat=torch.zeros(64, 0, dtype=torch.int64), label=torch.zeros(64))
    task = _OutOfMemoryAbove(16)
    ratio = measure_fp32_slowdown(model, task, batch, torch.device("cpu"), "bf16", steps=1)  # type: ignore[arg-type]
    assert ratio > 0 and task.tried[:3] == [64, 32, 16]
    assert measure_fp32_slowdown(model, _OutOfMemoryAbove(0), batch, torch.device("cpu"), "bf16",  # type: ignore[arg-type]
                                 steps=1) == 1.0


def test_the_memory_budget_is_what_this_process_can_have_not_the_devices_total() -> None:
    gib = 1 << 30
    assert cuda_memory_budget(free=80 * gib, reserved=0, total=80 * gib, fraction=0.9) == int(72 * gib)
    # Another process holds 30 GiB; this one holds 2 GiB (the model) that it can reuse.
    assert cuda_memory_budget(free=48 * gib, reserved=2 * gib, total=80 * gib, fraction=0.9) == int(45 * gib)


def test_text_tokens_are_cut_on_the_host_before_they_reach_the_device() -> None:
    """The encoder would otherwise read the batch's longest length from the GPU every step."""
    tok = torch.zeros(4, 2, 64, dtype=torch.int32)
    ntok = torch.tensor([[3, 10], [1, 1], [17, 2], [5, 5]])
    batch = Batch(num=torch.zeros(4, 0), cat=torch.zeros(4, 0, dtype=torch.int64), tok=tok, ntok=ntok,
                  label=torch.zeros(4))
    assert to_device(batch, torch.device("meta")).tok.shape == (4, 2, 32)
    assert to_device(batch, torch.device("meta"), cut_text=False).tok.shape == (4, 2, 64)
