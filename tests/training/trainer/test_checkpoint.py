from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from training.trainer.checkpoint import (
    AsyncCheckpointer,
    CheckpointManifest,
    apply_retention,
    latest_verified_checkpoint,
    list_checkpoints,
    load_checkpoint_state,
    save_checkpoint,
    step_dir_name,
)


def _save(root: Path, step: int) -> Path:
    return save_checkpoint(root, CheckpointManifest(step, "run", "cfg", {}), {"w": torch.full((64,), float(step)), "step": step})


def test_newest_verified_wins(tmp_path: Path) -> None:
    for s in (10, 20, 30):
        _save(tmp_path, s)
    path, manifest = latest_verified_checkpoint(tmp_path)
    assert manifest.step == 30 and path.name == "step-00000030"
    assert load_checkpoint_state(path)["step"] == 30


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing file", "no manifest"])
def test_damaged_newest_falls_back_with_a_warning(tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    _save(tmp_path, 10)
    newest = _save(tmp_path, 20)
    state = newest / "state.pt"
    if damage == "flip":
        data = bytearray(state.read_bytes())
        data[len(data) // 2] ^= 0x01
        state.write_bytes(bytes(data))
    elif damage == "truncate":
        state.write_bytes(state.read_bytes()[:100])
    elif damage == "missing file":
        state.unlink()
    else:
        (newest / "manifest.json").unlink()
    with caplog.at_level(logging.WARNING):
        path, manifest = latest_verified_checkpoint(tmp_path)
    assert manifest.step == 10
    assert "step-00000020" in caplog.text


def test_torn_temp_folder_is_ignored(tmp_path: Path) -> None:
    _save(tmp_path, 10)
    torn = tmp_path / ".step-00000020.tmp-99999"
    torn.mkdir()
    (torn / "state.pt").write_bytes(b"partial")
    assert latest_verified_checkpoint(tmp_path)[1].step == 10


def test_retention_keeps_last_k_plus_protected(tmp_path: Path) -> None:
    for s in (10, 20, 30, 40, 50):
        _save(tmp_path, s)
    apply_retention(tmp_path, keep_last=2, protect={20})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000050", "step-00000040", "step-00000020"]


def test_states_load_without_executing_code(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    path = save_checkpoint(tmp_path, CheckpointManifest(1, "run", "cfg", {}), {"x": Evil()})
    from training.errors import CheckpointError

    with pytest.raises(CheckpointError, match="cannot load"):
        load_checkpoint_state(path)


def test_retention_keeps_a_checkpoint_still_being_uploaded(tmp_path: Path) -> None:
    """On a slow link later checkpoints are saved while one uploads; deleting it under the
    upload could leave S3 without any checkpoint for as long as the link stays slow."""
    from training.trainer.checkpoint import AsyncCheckpointer

    uploading = {10}
    checkpointer = AsyncCheckpointer(tmp_path, keep_last=1, in_use=lambda: set(uploading))
    for step in (10, 20, 30):
        checkpointer.save(CheckpointManifest(step, "run", "cfg", {}), {"step": step}, protect=set(), blocking=True)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000030", "step-00000010"]
    uploading.clear()  # its upload ended
    checkpointer.save(CheckpointManifest(40, "run", "cfg", {}), {"step": 40}, protect=set(), blocking=True)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000040"]


def test_background_saves_reuse_one_copy_and_write_each_saves_values(tmp_path: Path) -> None:
    """The snapshot buffers are kept between saves (no fresh 100 MB allocation per save), and
    each checkpoint still holds the values of its own step, never the next step's."""
    weights = torch.zeros(1000)
    state = {"model": {"w": weights}, "rng": [torch.arange(3)], "step": 0}
    checkpointer = AsyncCheckpointer(tmp_path, keep_last=5)
    copies = []
    for step in (1, 2, 3):
        weights.fill_(step)  # training goes on mutating the live tensors
        state["step"] = step
        checkpointer.save(CheckpointManifest(step, "run", "cfg", {}), state, set())
        copies.append(checkpointer._copy["model"]["w"])
        weights.fill_(-1)  # the step after the save: must not reach the checkpoint being written
    checkpointer.wait()
    assert copies[0] is copies[1] is copies[2]  # one buffer, overwritten save after save
    for step in (1, 2, 3):
        saved = load_checkpoint_state(tmp_path / step_dir_name(step))
        assert saved["step"] == step and torch.equal(saved["model"]["w"], torch.full((1000,), float(step)))


# The writer is held at one point of its write (its real code, with one function wrapped to stop
# there and say so), then SIGKILLed: as when a spot machine dies in the middle of a save.
_HELD_WRITER = r"""
import sys, threading
from pathlib import Path
import torch
import training.storage.files as files
import training.trainer.checkpoint as checkpoint

root, where, marker = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
checkpoint.save_checkpoint(root, checkpoint.CheckpointManifest(10, "run", "cfg", {}), {"w": torch.full((64,), 10.0)})

def hold() -> None:
    marker.write_text("held")
    threading.Event().wait()  # until the kill

if where == "mid-state":  # part of state.pt written, no manifest yet
    write = files.HashingWriter.write
    def held_write(self, data):
        n = write(self, data)
        if self.tell() > 1 << 20:
            self.flush()
            hold()
        return n
    files.HashingWriter.write = held_write
else:  # state.pt and manifest.json written and synced, the folder not yet renamed
    sync = checkpoint.fsync_dir
    def held_sync(path):
        sync(path)
        if ".tmp-" in path.name:
            hold()
    checkpoint.fsync_dir = held_sync
checkpoint.save_checkpoint(root, checkpoint.CheckpointManifest(20, "run", "cfg", {}), {"w": torch.randn(1 << 20)})
"""


@pytest.mark.parametrize("where", ["mid-state", "before-rename"])
def test_a_writer_killed_during_its_write_leaves_the_previous_checkpoint_the_one_resumed(
        tmp_path: Path, where: str) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    root, marker = tmp_path / "checkpoints", tmp_path / "held"
    writer = subprocess.Popen([sys.executable, "-c", _HELD_WRITER, str(root), where, str(marker)],
                              cwd=Path(__file__).parents[3])
    try:
        while not marker.exists():  # the state the kill must land in, not a duration
            assert writer.poll() is None, f"the writer exited ({writer.returncode}) before its held point"
            time.sleep(0.01)
        os.kill(writer.pid, signal.SIGKILL)
    finally:
        writer.kill()
        writer.wait()
    (torn,) = root.glob(".step-00000020.tmp-*")
    assert (torn / "manifest.json").exists() == (where == "before-rename")
    path, manifest = latest_verified_checkpoint(root)
    assert manifest.step == 10 and path.name == step_dir_name(10)
    assert torch.equal(load_checkpoint_state(path)["w"], torch.full((64,), 10.0))
    # The next save's retention clears the dead writer's leftovers, never the resumed one.
    _save(root, 30)
    apply_retention(root, keep_last=2, protect=set())
    assert not list(root.glob(".step-*")) and [p.name for p in list_checkpoints(root)] == [
        step_dir_name(30), step_dir_name(10)]
