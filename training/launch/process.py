"""Run the training loop in a child process and map how it ended to the error hierarchy.

A child process, not a thread: a hard kill of the child (OOM killer, SIGKILL) leaves the task
process alive to report `Preempted`, and the task's retry starts a fresh child that resumes
from the last verified checkpoint.

With `train.distributed.nproc_per_node` above 1 the child is PyTorch's own launcher,
`python -m torch.distributed.run` (torchrun), which starts one `training.worker.train` per rank. It
runs with `--max-restarts 0`: when a rank dies torchrun stops the others and exits, and the
Prefect task's retry (one code path for every kind of preemption) resumes the job. Several
nodes are started by TorchX instead (`training.launch.group`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Callable

import training
from training import errors
from training.errors import EXIT_PREEMPTED, EXIT_USER_ERROR, ConfigError, Preempted, RetrainError
from training.launch.child import Child, WarmPool
from training.launch.forks import ChildProcess
from training.protocol.entries import WORKER_MODULE
from training.protocol.events import ChildEvent, ErrorReport, LogLine, read_event
from training.protocol.job import TrainJob
from training.protocol.results import RungResult, TrainResult
from training.protocol.runs import count_attempt, rung_file
from training.protocol.sealed import Sealed

__all__ = ["run_training_process", "run_rung_process", "worker_command", "child_env", "error_class", "free_loopback_port",
           "log_child_event", "rank_errors", "rebuild_error", "with_parent_death_signal"]

_TERM_GRACE_SECONDS = 60.0
_RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:")  # torchrun may prefix rank output lines


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    project_root = str(Path(training.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (project_root, env.get("PYTHONPATH")) if p)
    env["RETRAIN_SPAWN_TIME"] = repr(time.time())
    env["PYTHONUNBUFFERED"] = "1"
    return env


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_command(job: TrainJob, sealed: Sealed, error_path: Path) -> list[str]:
    """The child of a one-node job: the worker, or torchrun with one worker per process; the
    job's seal on its command line."""
    worker = ["-m", WORKER_MODULE, sealed.arg(), str(error_path), str(os.getpid())]
    tc = job.config.train
    nproc = tc.distributed.nproc_per_node
    if tc.distributed.nnodes > 1:
        raise ConfigError("only the train task runs on several nodes (train.distributed.nnodes > 1); tuning and the "
                          "plan's calibration run on one: set train.distributed.nnodes: 1 for them")
    if nproc == 1:
        return [sys.executable, *worker]
    # One node: the rendezvous and gloo stay on loopback.
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1",
               "--max-restarts=0", "--monitor-interval=0.5", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{free_loopback_port()}", f"--rdzv-id={job.run_key}"]
    # torchrun has no parent-death signal: if the task process dies, SIGTERM it so that it
    # stops its ranks (which then write their emergency checkpoint), instead of an orphan job.
    return with_parent_death_signal([*command, *worker])


def with_parent_death_signal(argv: list[str]) -> list[str]:
    """`argv` run so that it gets SIGTERM when the process that started it dies (Linux
    PR_SET_PDEATHSIG, set in a tiny exec wrapper; elsewhere the wrapper only execs)."""
    return [sys.executable, "-c", _EXEC_WITH_PDEATHSIG, *argv]


_EXEC_WITH_PDEATHSIG = (
    "import ctypes, os, sys\n"
    "try:\n    ctypes.CDLL('libc.so.6').prctl(1, 15)\nexcept OSError:\n    pass\n"
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def error_class(report: ErrorReport) -> type[RetrainError]:
    """The error class the child raised, from this process's own hierarchy (never a name
    imported from elsewhere: only RetrainError subclasses cross)."""
    cls = getattr(errors, report.type, None)
    return cls if isinstance(cls, type) and issubclass(cls, RetrainError) else RetrainError


def rebuild_error(report: ErrorReport) -> RetrainError:
    """The child's error as this process's: the same class and message, and a storage error's
    `transient`, which decides whether the task retries it."""
    cls = error_class(report)
    if issubclass(cls, errors.StorageError):
        return cls(report.message, transient=report.transient)
    return cls(report.message)


def rank_errors(error_path: Path) -> list[ErrorReport]:
    found = []
    for path in sorted(error_path.parent.glob(error_path.name + "*")):
        try:
            found.append(ErrorReport.model_validate_json(path.read_text()))
        except (OSError, ValueError):
            continue
        path.unlink(missing_ok=True)
    return found


def log_child_event(event: ChildEvent) -> None:
    """The default handler of the child's events: its warnings and errors (`log` events) go to
    this process's logging; progress events are dropped."""
    if isinstance(event, LogLine):
        level = logging.getLevelName(event.level)
        logging.getLogger("training.launch.child").log(level if isinstance(level, int) else logging.WARNING,
                                                        "%s", event.message)


def _dispatch(line: str, on_event: Callable[[ChildEvent], None]) -> None:
    event = read_event(_RANK_PREFIX.sub("", line, count=1))
    if event is None:
        sys.stderr.write(line)  # a user model printing to stdout: pass it through
        return
    on_event(event)


def run_training_process(
    job: TrainJob,
    on_event: Callable[[ChildEvent], None] = log_child_event,
    on_start: Callable[[ChildProcess], None] = lambda proc: None,
    pool: WarmPool | None = None,
) -> TrainResult:
    """Train `job` in a child process (a warm one from `pool`, when it has one); return its
    result, or raise Preempted / a RetrainError."""
    return _outcome(job, *_launch(job, on_event, on_start, pool))


def run_rung_process(job: TrainJob, on_event: Callable[[ChildEvent], None] = log_child_event,
                     pool: WarmPool | None = None) -> RungResult:
    """Train `job` in a child process up to its `pause_at` step (a tuning rung) or its end."""
    assert job.pause_at is not None
    rc, error_path, reported, distributed = _launch(job, on_event, lambda proc: None, pool)
    paused = Path(job.run_dir) / rung_file(job.pause_at)
    if rc == 0 and not (Path(job.run_dir) / "result.json").exists() and paused.exists():
        return RungResult.model_validate_json(paused.read_text())
    return RungResult.of(_outcome(job, rc, error_path, reported, distributed))


def _launch(job: TrainJob, on_event: Callable[[ChildEvent], None],
            on_start: Callable[[ChildProcess], None],
            pool: WarmPool | None) -> tuple[int, Path, list[ErrorReport], bool]:
    """Run the job in a child to its end: (exit code, its error file, the errors it reported,
    under torchrun). With a pool, a single-process job runs in a warm child when one is idle,
    and its child goes back to the pool afterwards."""
    run_dir = Path(job.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    error_path = run_dir / f"error-{os.getpid()}.json"
    error_path.unlink(missing_ok=True)
    # In the run's folder, where it records what the run began with; sealed, so that the child
    # trains this job and no other, whoever writes the root meanwhile.
    job.pin_inputs()
    sealed = job.seal(run_dir / "job.json")
    count_attempt(run_dir)
    for stale in error_path.parent.glob(error_path.name + ".rank*"):
        stale.unlink(missing_ok=True)
    command = worker_command(job, sealed, error_path)
    distributed = command[1] == "-c"
    keep = pool if pool is not None and not distributed else None
    child = keep.take() if keep is not None else None
    if child is not None and not child.hand(sealed, error_path):
        child.close()  # it died while idle
        child = None
    if child is None:
        env = child_env()
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo would pick the hostname's interface otherwise
        child = Child(command, env, hold=keep is not None)
        on_start(child.proc)
    reported: list[ErrorReport] = []  # the error file may be on a full disk

    def on_line(event: ChildEvent) -> None:
        if isinstance(event, ErrorReport):
            reported.append(event)
        else:
            on_event(event)

    rc: int | None = None
    try:
        rc = child.follow(lambda line: _dispatch(line, on_line))
    except BaseException as err:
        # The task itself is being stopped (SIGTERM, Ctrl-C, cancellation): let the child write
        # its emergency checkpoint before we go, and pass on what it said meanwhile (the
        # checkpoint's event is how the caller can tell where it stopped). Its own session keeps
        # the terminal's Ctrl-C from it: it is passed on as SIGINT, so the run records a user's
        # interrupt, not a preemption.
        child.stop(_TERM_GRACE_SECONDS, signal.SIGINT if isinstance(err, KeyboardInterrupt) else signal.SIGTERM)
        with contextlib.suppress(Exception):
            child.follow(lambda line: _dispatch(line, on_line))
        raise
    finally:
        child.kill_group()
    if rc is None:  # idle again: the job ended with exit code 0
        assert keep is not None
        keep.give(child)
        return 0, error_path, reported, distributed
    return rc, error_path, reported, distributed


def _outcome(job: TrainJob, rc: int, error_path: Path, reported: list[ErrorReport], distributed: bool) -> TrainResult:
    """The finished child's result, or the error its exit code and error reports say."""
    if rc == 0:
        path = Path(job.run_dir) / "result.json"
        try:
            return TrainResult.model_validate_json(path.read_bytes())
        except (OSError, ValueError):
            # Written by the child just now, but the root is shared: removed or replaced since.
            # The run is complete on its checkpoints; the retry writes the record again from them.
            raise Preempted(f"training process for run {job.run_key} finished, but its {path} is missing or "
                            "damaged (another writer of the storage root?); the retry writes it again") from None
    if rc == EXIT_PREEMPTED:
        raise Preempted(f"training process for run {job.run_key} was preempted and checkpointed")
    if rc < 0:
        name = signal.Signals(-rc).name
        raise Preempted(f"training process for run {job.run_key} was killed by {name}")
    if rc == EXIT_USER_ERROR and (reported or error_path.exists()):
        report = reported[-1] if reported else ErrorReport.model_validate_json(error_path.read_text())
        error_path.unlink(missing_ok=True)
        raise rebuild_error(report)
    if distributed:
        # torchrun exits 1 whatever its ranks did: their error files say what happened. A user
        # error on any rank wins; otherwise a rank was killed or lost its peers: a preemption.
        for report in reported + rank_errors(error_path):
            if report.type == "Bug":
                raise RuntimeError(f"training job {job.run_key} failed on a rank: {report.message}; see its log above")
            if error_class(report) is not Preempted:
                raise rebuild_error(report)
        raise Preempted(f"training job {job.run_key} lost a rank (torchrun exit code {rc}); resuming on retry")
    bug = next((report for report in [*reported, *rank_errors(error_path)] if report.type == "Bug"), None)
    detail = f": {bug.message}" if bug else f" with exit code {rc}"
    raise RuntimeError(f"training process for run {job.run_key} failed{detail} (a bug: its traceback is in the "
                       "training log above)")
