"""Real processes, real signals: SIGKILL and SIGTERM on the training child process."""

from __future__ import annotations

import http.server
import os
import random
import signal
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.training.helpers import make_job
from training.protocol.events import ChildEvent
from training.protocol.results import TrainResult
from training.trainer.checkpoint import latest_verified_checkpoint
from training.config import RetrainConfig
from training.errors import Preempted
from training.launch.process import run_training_process
from training.protocol.job import TrainJob


def _heartbeat_step(job: TrainJob, since: float = 0.0) -> int:
    """The heartbeat's step, if this attempt wrote it (mtime after `since`), else -1."""
    path = Path(job.run_dir) / "heartbeat.bin"
    try:
        if path.stat().st_mtime < since:
            return -1  # still the previous attempt's value
        data = path.read_bytes()
    except FileNotFoundError:
        return -1
    return struct.unpack("<qd", data)[0] if len(data) == 16 else -1


def _signal_at_step(job: TrainJob, step: int, sig: signal.Signals):
    """on_start callback: send `sig` to the child once it has completed `step` steps."""
    seen: dict[str, int] = {}

    def on_start(proc: subprocess.Popen) -> None:
        started = time.time()

        def watch() -> None:
            while proc.poll() is None:
                current = _heartbeat_step(job, since=started)
                if current >= step:
                    seen["step"] = current
                    proc.send_signal(sig)
                    return
                time.sleep(0.005)

        threading.Thread(target=watch, daemon=True).start()

    return on_start, seen


@pytest.fixture
def long_config(small_config: RetrainConfig) -> RetrainConfig:
    small_config.train.max_steps = 400
    small_config.train.eval_every = 50
    small_config.train.checkpoint.every = 25
    return small_config


@pytest.mark.slow
def test_three_sigkills_resume_bit_identical(long_config: RetrainConfig) -> None:
    reference = run_training_process(make_job(long_config, "reference"))
    job = make_job(long_config, "killed")
    targets = sorted(random.Random(os.getpid()).sample(range(5, 395), 3))
    for target in targets:
        on_start, _ = _signal_at_step(job, target, signal.SIGKILL)
        with pytest.raises(Preempted, match="SIGKILL"):
            run_training_process(job, on_start=on_start)
    final = run_training_process(job)
    assert final.model.sha256 == reference.model.sha256, f"kills at steps {targets}"
    assert final.history == reference.history
    assert final.preemptions == 3 and len(final.resumed_from_steps) == 3
    # no data replayed or skipped: the resumed run trained exactly max_steps optimizer steps
    assert final.samples_seen == reference.samples_seen


@pytest.mark.slow
def test_sigterm_loses_at_most_one_step(long_config: RetrainConfig) -> None:
    job = make_job(long_config)
    on_start, seen = _signal_at_step(job, 137, signal.SIGTERM)
    with pytest.raises(Preempted, match="preempted and checkpointed"):
        run_training_process(job, on_start=on_start)
    _, manifest = latest_verified_checkpoint(Path(job.run_dir) / "checkpoints")
    assert manifest.emergency
    assert manifest.step >= seen["step"]  # the step in flight was finished, then saved
    assert _heartbeat_step(job) - manifest.step <= 1
    final = run_training_process(job)
    assert final.status == "completed"
    assert final.steps_lost <= 1
    assert final.resumed_from_steps == [manifest.step]


class _SpotNotice(http.server.BaseHTTPRequestHandler):
    calls = 0

    def do_GET(self) -> None:
        type(self).calls += 1
        if type(self).calls < 3:
            self.send_response(404)
            self.end_headers()
            return
        body = b'{"action": "terminate", "time": "2026-11-21T03:00:00Z"}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.slow
def test_spot_notice_poller_checkpoints_and_exits(long_config: RetrainConfig) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SpotNotice)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        long_config.train.max_steps = 100_000
        long_config.train.checkpoint.spot_notice_url = f"http://127.0.0.1:{server.server_port}/latest/meta-data/spot/instance-action"
        long_config.train.checkpoint.spot_poll_seconds = 0.2
        job = make_job(long_config)
        with pytest.raises(Preempted):
            run_training_process(job)
        _, manifest = latest_verified_checkpoint(Path(job.run_dir) / "checkpoints")
        assert manifest.emergency and _SpotNotice.calls >= 3
    finally:
        server.shutdown()


@pytest.mark.slow
def test_an_attempt_killed_during_start_up_still_counts(long_config: RetrainConfig,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    job = make_job(long_config)
    on_start, _ = _signal_at_step(job, 30, signal.SIGKILL)
    with pytest.raises(Preempted):
        run_training_process(job, on_start=on_start)

    def kill_at_once(proc: subprocess.Popen) -> None:
        proc.kill()  # in its start-up, before any checkpoint is read

    # A fresh process, not one forked from the zygote: a forked child has its imports done and
    # can resume in the moment before the kill lands; a fresh one is still starting Python.
    with monkeypatch.context() as fresh:
        fresh.setenv("RETRAIN_NO_ZYGOTE", "1")
        with pytest.raises(Preempted):
            run_training_process(job, on_start=kill_at_once)
    final = run_training_process(job)
    assert final.preemptions == 2
    assert len(final.resumed_from_steps) == 1  # only one attempt got as far as resuming


@pytest.mark.slow
def test_an_attempt_killed_before_its_first_checkpoint_keeps_its_record(long_config: RetrainConfig) -> None:
    job = make_job(long_config)
    for target in (100, 103):  # the second attempt dies a few steps after resuming, before any save
        on_start, _ = _signal_at_step(job, target, signal.SIGKILL)
        with pytest.raises(Preempted):
            run_training_process(job, on_start=on_start)
    final = run_training_process(job)
    assert final.preemptions == 2
    assert len(final.resumed_from_steps) == 2  # both resumes, though only one attempt checkpointed
    assert final.steps_lost >= 1


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry))
    return members


def test_sigkill_with_dataloader_workers_neither_hangs_nor_leaves_orphans(long_config: RetrainConfig) -> None:
    """The DataLoader's worker processes outlive a SIGKILLed training process and hold its
    stdout: the launcher must not wait for that pipe, and must not leave them running."""
    long_config.train.loader.num_workers = 1
    job = make_job(long_config)
    on_start, seen = _signal_at_step(job, 30, signal.SIGKILL)
    started: dict[str, int] = {}

    def record(proc: subprocess.Popen) -> None:
        started["pgid"] = proc.pid
        on_start(proc)

    with pytest.raises(Preempted):
        run_training_process(job, on_start=record)
    assert seen["step"] >= 30
    deadline = time.time() + 60
    while _group_members(started["pgid"]) and time.time() < deadline:
        time.sleep(0.1)
    assert _group_members(started["pgid"]) == []


def test_small_data_trains_with_the_default_batch_and_resumes_bit_identical(tmp_path: Path) -> None:
    """569 rows (the size of a real dataset that failed before): the train split is smaller than
    the default batch of 512, so a batch is the whole split, with a warning; a kill and resume
    ends exactly where an uninterrupted run does, the step it keeps (ties broken by the
    validation loss, kept in the checkpoint) included."""
    from tests.conftest import small_overrides
    from training.config import load_config
    from training.data.ingest.demo import ensure_demo_dataset

    source, _ = ensure_demo_dataset(tmp_path / "src", rows=569, seed=3)
    overrides = [o for o in small_overrides(tmp_path / "root", source) if not o.startswith("train.batch_size")]
    config = load_config(overrides=overrides + ["train.max_steps=40", "train.eval_every=10",
                                                "train.checkpoint.every=10"])
    assert config.train.batch_size == 512  # the default
    events: list[ChildEvent] = []
    reference = run_training_process(make_job(config, "reference"), on_event=events.append)
    (warning,) = [e for e in events if e.event == "log" and "fewer than train.batch_size 512" in e.message]
    assert warning.level == "WARNING"
    # And its validation split is too small for AUC alone to pick the step the run keeps: said once.
    (small,) = [e for e in events if e.event == "log" and "the validation split holds" in e.message]
    assert small.level == "WARNING" and "lowest validation logloss" in small.message
    job = make_job(config, "killed")
    on_start, _ = _signal_at_step(job, 15, signal.SIGKILL)
    with pytest.raises(Preempted):
        run_training_process(job, on_start=on_start)
    final = run_training_process(job)
    assert final.resumed_from_steps and final.model.sha256 == reference.model.sha256
    assert final.history == reference.history


@pytest.mark.slow
def test_a_second_process_on_a_run_in_training_is_refused_and_the_first_is_unharmed(long_config: RetrainConfig) -> None:
    """Seen: two processes trained one run folder at once, and the second's report showed a
    preemption that never happened (it read the live process's heartbeat)."""
    from training.errors import StorageError

    # Long enough that the first is still training when the second has started (about 2 s of
    # imports): 400 steps of this small model took under a second on one thread.
    long_config.train.max_steps = 6000
    long_config.train.eval_every = 1000
    long_config.train.checkpoint.every = 500
    long_config.train.patience = 0
    job = make_job(long_config)
    results: dict[str, object] = {}

    def first() -> None:
        results["first"] = run_training_process(job)

    thread = threading.Thread(target=first)
    thread.start()
    deadline = time.time() + 120
    while _heartbeat_step(job) < 5:
        assert time.time() < deadline
        time.sleep(0.01)
    with pytest.raises(StorageError, match="being trained by another live process"):
        run_training_process(job)
    thread.join(timeout=300)
    result = results["first"]
    assert isinstance(result, TrainResult) and result.status == "completed"
    assert result.preemptions == 0 and result.steps_lost == 0


def test_retention_removes_only_dead_writers_temp_folders(tmp_path: Path) -> None:
    from training.trainer.checkpoint import apply_retention

    alive = subprocess.Popen(["sleep", "60"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        ckpts = tmp_path / "checkpoints"
        (ckpts / f".step-00000100.tmp-{alive.pid}").mkdir(parents=True)
        (ckpts / f".step-00000100.tmp-{dead.pid}").mkdir()
        apply_retention(ckpts, keep_last=1, protect=set())
        assert sorted(p.name for p in ckpts.iterdir()) == [f".step-00000100.tmp-{alive.pid}"]
    finally:
        alive.kill()
        alive.wait()
