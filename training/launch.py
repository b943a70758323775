"""Run the training loop in a child process and map how it ended to the error hierarchy.

A child process, not a thread: a hard kill of the child (OOM killer, SIGKILL) leaves the task
process alive to report `Preempted`, and the task's retry starts a fresh child that resumes
from the last verified checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import training
from training import errors
from training.errors import EXIT_PREEMPTED, EXIT_USER_ERROR, Preempted, RetrainError
from training.loop import TrainJob, count_attempt

__all__ = ["run_training_process"]

_TERM_GRACE_SECONDS = 60.0


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    project_root = str(Path(training.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (project_root, env.get("PYTHONPATH")) if p)
    env["RETRAIN_SPAWN_TIME"] = repr(time.time())
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_training_process(
    job: TrainJob,
    on_event: Callable[[dict[str, Any]], None] = lambda event: None,
    on_start: Callable[[subprocess.Popen[str]], None] = lambda proc: None,
) -> dict[str, Any]:
    """Train `job` in a child process; return its result, or raise Preempted / a RetrainError."""
    run_dir = Path(job.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    job_path = run_dir / "job.json"
    error_path = run_dir / f"error-{os.getpid()}.json"
    error_path.unlink(missing_ok=True)
    job.save(job_path)
    count_attempt(run_dir)
    proc = subprocess.Popen(
        [sys.executable, "-m", "training.worker", str(job_path), str(error_path), str(os.getpid())],
        stdout=subprocess.PIPE,
        text=True,
        env=_child_env(),
    )
    on_start(proc)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                sys.stderr.write(line)  # a user model printing to stdout: pass it through
                continue
            on_event(event)
        rc = proc.wait()
    except BaseException:
        # The task itself is being stopped (SIGTERM, Ctrl-C, cancellation): let the child write
        # its emergency checkpoint before we go.
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=_TERM_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                proc.kill()
        raise

    if rc == 0:
        result = json.loads((run_dir / "result.json").read_text())
        return result
    if rc == EXIT_PREEMPTED:
        raise Preempted(f"training process for run {job.run_key} was preempted and checkpointed")
    if rc < 0:
        name = signal.Signals(-rc).name
        raise Preempted(f"training process for run {job.run_key} was killed by {name}")
    if rc == EXIT_USER_ERROR and error_path.exists():
        raw = json.loads(error_path.read_text())
        error_path.unlink(missing_ok=True)
        cls = getattr(errors, raw["type"], RetrainError)
        raise cls(raw["message"])
    raise RuntimeError(f"training process for run {job.run_key} failed with exit code {rc}; see its log above")
