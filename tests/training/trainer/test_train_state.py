"""The TrainState saves and restores as one unit: a round trip through a checkpoint file
continues bit-identically, and no part can be saved without being restored."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from training.config import load_config
from training.model.network import ModelSchema
from training.protocol.results import Validation
from training.trainer.state import Progress, TrainState


def _state(seed: int) -> TrainState:
    torch.manual_seed(seed)
    config = load_config(overrides=["train.max_steps=50", "train.schedule.warmup_steps=5", "train.patience=3"])
    schema = ModelSchema("binary", 1, ["a", "b", "c", "d"], ["e", "f"], [5, 7], numeric_bins=[[-1.0, 0.0, 1.0]] * 4)
    return TrainState.create(config, schema, device=torch.device("cpu"), precision="fp32")


def _step(state: TrainState) -> float:
    """One optimizer step on random data drawn from the global torch RNG (so RNG state matters)."""
    x_num, x_cat = torch.randn(16, 4), torch.stack([torch.randint(0, 5, (16,)), torch.randint(0, 7, (16,))], 1)
    y = torch.randint(0, 2, (16,)).float()
    state.optimizer.zero_grad()
    loss = F.binary_cross_entropy_with_logits(state.model({"num": x_num, "cat": x_cat}).float(), y)
    state.scaler.scale(loss).backward()
    state.scaler.step(state.optimizer)
    state.scaler.update()
    state.scheduler.step()
    state.progress.step += 1
    value = float(loss.detach())
    state.progress.history.append(Validation(step=state.progress.step, train_loss=value, metrics={}))
    state.stopper.update(-value, state.progress.step)
    return value


def test_a_round_trip_through_a_file_continues_bit_identically(tmp_path: Path) -> None:
    original = _state(seed=1)
    for _ in range(7):
        _step(original)
    original.progress.seconds.train = 12.5
    path = tmp_path / "state.pt"
    torch.save(original.state_dict(), path)
    expected = [_step(original) for _ in range(5)]

    restored = _state(seed=2)  # different initial weights and RNG: everything must come from the file
    restored.load_state_dict(torch.load(path, weights_only=True))
    assert restored.progress.step == 7 and restored.progress.seconds.train == 12.5
    assert [_step(restored) for _ in range(5)] == expected  # weights, optimizer, schedule and RNG
    for a, b in zip(original.model.state_dict().values(), restored.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert restored.stopper.state_dict() == original.stopper.state_dict()
    assert restored.progress.state_dict() == original.progress.state_dict()
    assert restored.scheduler.get_last_lr() == original.scheduler.get_last_lr()


def test_every_saved_part_is_restored_and_nothing_else_is_read() -> None:
    state = _state(seed=1)
    _step(state)
    saved = state.state_dict()
    assert set(saved) == {"model", "optimizer", "scheduler", "scaler", "early_stopping", "run", "rng"}
    read: set[str] = set()

    class Recording(dict):  # type: ignore[type-arg]
        def __getitem__(self, key: str) -> object:
            read.add(key)
            return super().__getitem__(key)

    _state(seed=3).load_state_dict(Recording(saved))
    assert read == set(saved)  # a part added to the state is saved and restored, never one alone


def test_progress_from_an_older_checkpoint_gains_new_accumulators_at_zero() -> None:
    progress = Progress()
    old = progress.state_dict()
    old["seconds"] = {"train": 3.0}  # written before the other accumulators existed
    progress.load_state_dict(old)
    assert progress.seconds.train == 3.0 and progress.seconds.startup == 0.0
    assert progress.billed_seconds() == 3.0
