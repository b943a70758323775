"""Training children forked from the zygote: a forked child computes what a fresh process
computes, is seen by the launcher as a fresh one is (exit codes, signals), still gets SIGTERM
when its parent's side goes, and a parent whose import-time environment changed gets a zygote
started with it."""

from __future__ import annotations

import os
import signal
import textwrap
import threading
from pathlib import Path

import pytest

from training.config import RetrainConfig
from training.errors import Preempted
from training.launch import forks
from training.launch.forks import ForkedProcess
from training.protocol.numerics import gpu_driver_present
from training.launch.process import run_training_process

from tests.training.helpers import make_job

pytestmark = pytest.mark.skipif(gpu_driver_present(), reason="children start fresh where there is a GPU driver")


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _recording_starts() -> tuple[list[object], object]:
    started: list[object] = []
    return started, started.append


def test_a_forked_child_trains_what_a_fresh_process_trains(small_config: RetrainConfig,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    started, on_start = _recording_starts()
    forked = run_training_process(make_job(small_config, "forked"), on_start=on_start)  # type: ignore[arg-type]
    assert isinstance(started[0], ForkedProcess), "the child was not forked from the zygote"
    monkeypatch.setenv("RETRAIN_NO_ZYGOTE", "1")
    fresh = run_training_process(make_job(small_config, "fresh"), on_start=on_start)  # type: ignore[arg-type]
    assert not isinstance(started[1], ForkedProcess)
    assert forked.model.sha256 == fresh.model.sha256 and forked.history == fresh.history


def test_a_forked_child_killed_by_a_signal_is_a_preemption_that_resumes(small_config: RetrainConfig) -> None:
    reference = run_training_process(make_job(small_config, "reference"))
    job = make_job(small_config, "killed")
    seen: dict[str, int] = {}

    def on_start(proc: forks.ChildProcess) -> None:
        assert isinstance(proc, ForkedProcess)
        seen["parent"] = _parent_of(proc.pid)
        seen["zygote"] = forks._zygote.pid if forks._zygote is not None else -1
        proc.send_signal(signal.SIGKILL)

    with pytest.raises(Preempted, match="SIGKILL"):
        run_training_process(job, on_start=on_start)
    assert seen["parent"] == seen["zygote"]
    assert run_training_process(job).model.sha256 == reference.model.sha256


def test_when_the_zygote_dies_its_child_checkpoints_and_a_new_zygote_resumes_it(small_config: RetrainConfig) -> None:
    small_config.train.max_steps = 400
    job = make_job(small_config, "orphaned")
    killed = threading.Event()

    def kill_zygote_at_the_first_checkpoint(event: object) -> None:
        if getattr(event, "event", None) == "checkpoint" and not killed.is_set():
            assert forks._zygote is not None
            killed.set()
            os.kill(forks._zygote.pid, signal.SIGKILL)

    with pytest.raises(Preempted):
        run_training_process(job, on_event=kill_zygote_at_the_first_checkpoint)  # type: ignore[arg-type]
    started, on_start = _recording_starts()
    final = run_training_process(job, on_start=on_start)  # type: ignore[arg-type]
    assert isinstance(started[0], ForkedProcess)
    assert final.resumed_from_steps, "the orphaned child left no checkpoint to resume from"
    assert final.steps == 400


def test_an_import_time_variable_that_changed_gets_a_new_zygote(small_config: RetrainConfig,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    run_training_process(make_job(small_config, "first"))
    assert forks._zygote is not None
    first = forks._zygote.pid
    monkeypatch.setenv("OMP_NUM_THREADS", "2" if os.environ.get("OMP_NUM_THREADS") == "1" else "1")
    run_training_process(make_job(small_config, "second"))
    assert forks._zygote is not None and forks._zygote.pid != first
    with pytest.raises(ProcessLookupError):
        os.kill(first, 0)  # the old one was closed


def test_a_factory_module_in_the_working_folder_is_found(small_config: RetrainConfig, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m` puts the working folder first on sys.path, so a fresh worker finds a user's
    factory module there: a forked one must too, although its zygote started elsewhere."""
    small_config.train.max_steps = 20
    monkeypatch.chdir(tmp_path)
    forks._close()
    run_training_process(make_job(small_config, "elsewhere"))  # the zygote starts in tmp_path
    assert forks._zygote is not None
    zygote = forks._zygote.pid
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "my_model.py").write_text(textwrap.dedent("""
        from tests.model_factories import linear as build
    """))
    monkeypatch.chdir(folder)
    small_config.model.factory = "my_model:build"
    started, on_start = _recording_starts()
    assert run_training_process(make_job(small_config, "factory"), on_start=on_start).steps == 20  # type: ignore[arg-type]
    assert isinstance(started[0], ForkedProcess) and forks._zygote.pid == zygote
