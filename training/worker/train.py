"""Entry point of the training child process: `python -m training.worker.train JOB.json#sha256=HEX ERROR.json`.

The job is sealed by its parent (`training.protocol.sealed`): a job file that is not the one
the parent wrote is refused before anything in it is used.

Exit codes: 0 done, EXIT_PREEMPTED after an emergency checkpoint, EXIT_USER_ERROR with the
error written to ERROR.json. Progress events go to stdout as JSON lines, warnings and errors as `log` events among them;
other logs go to stderr.

Started with `--hold` (a tuning study's warm child, see training.launch.child), it takes further jobs
on stdin after one that ended with exit code 0.

Under torchrun (WORLD_SIZE > 1) each rank runs this module: it joins the process group (gloo
on CPU, nccl on CUDA) with `train.distributed.timeout_s` as the collective timeout, and writes its
errors to ERROR.json.rank<N>. A rank that loses a peer (killed, or a node gone) exits with
EXIT_PREEMPTED rather than hang: the task's retry resumes from the last checkpoint.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
from pathlib import Path

from training.errors import EXIT_PREEMPTED, EXIT_USER_ERROR, ConfigError, Preempted, RetrainError
from training.protocol.entries import HOLD_FLAG
from training.protocol.events import Done, ErrorReport, Idle, InGroup, JobOrder
from training.protocol.job import TrainJob
from training.protocol.results import RungResult
from training.protocol.sealed import Sealed
from training.trainer.run import StopFlag, train
from training.trainer.spot import start_spot_notice_poller
from training.worker.io import die_with_parent, emit, forward_logs, report_error

__all__ = ["main"]


def _configure_logging() -> None:
    terminal = logging.StreamHandler(sys.stderr)
    terminal.setFormatter(logging.Formatter("[train] %(levelname)s %(message)s"))
    forward_logs(terminal)


def _lost_peer(err: BaseException) -> bool:
    """A collective that failed because another rank died or hung, not because of a bug."""
    import torch.distributed as dist

    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(
        marker in text for marker in ("Connection closed by peer", "Connection reset", "Timed out", "timed out",
                                      "Broken pipe", "NCCL", "Gloo", "gloo")
    )


def _init_distributed(job: TrainJob) -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import datetime

    import torch
    import torch.distributed as dist

    train_cfg = job.config.train
    cuda = torch.cuda.is_available() and train_cfg.device != "cpu"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        backend="nccl" if cuda else "gloo",
        timeout=datetime.timedelta(seconds=train_cfg.distributed.timeout_s),
    )
    _same_job_everywhere(job, dist.get_rank(), world)
    return dist.get_rank(), world


def _numerics_as_keyed(job: TrainJob) -> None:
    """Refuse to train in other numerics than the run key was made for: the launcher of nodes on
    another machine keys the run for the nodes' declared hardware, and a node that resolves
    `train.device`/`train.precision` otherwise would train another run under that key."""
    if job.numerics is None:
        return
    from training.protocol.numerics import resolved_numerics

    tc = job.config.train
    here = list(resolved_numerics(tc.device, tc.precision))
    if tc.precision == "auto" and here[0] == job.numerics[0] and job.numerics[1] in ("fp32", here[1]):
        return  # auto measured on this kind of GPU (training.pipeline.precision_pick): fp32, or the native bf16
    if here != job.numerics:
        raise ConfigError(f"run {job.run_key[:12]} was keyed for {job.numerics[1]} on {job.numerics[0]}, but this "
                          f"machine resolves train.device {tc.device} and train.precision {tc.precision} to {here[1]} on "
                          f"{here[0]}: give the nodes the GPUs the config declares "
                          "(train.distributed.kubernetes.gpu), or set train.device and train.precision explicitly")


def _same_job_everywhere(job: TrainJob, rank: int, world: int) -> None:
    """Refuse to train unless every rank holds rank 0's job. Each node builds its job from the
    config it was given and the source it lists; a node started with other settings, or after a
    file was added, would otherwise train another run's data or hyperparameters inside the same
    gradients, in silence whenever the shapes happen to agree."""
    import torch.distributed as dist

    mine = (job.run_key, Path(job.dataset_dir).name)
    every: list[tuple[str, str] | None] = [None] * world
    dist.all_gather_object(every, mine)
    leader = every[0]
    assert leader is not None
    others = [r for r, held in enumerate(every) if held != leader]
    if others:
        held = every[others[0]]
        assert held is not None
        raise ConfigError(
            f"rank {others[0]}{f' and {len(others) - 1} more' if len(others) > 1 else ''} joined with another job than "
            f"rank 0's: run {held[0][:12]} on dataset {held[1][:12]}, against run {leader[0][:12]} on dataset "
            f"{leader[1][:12]} (this is rank {rank}). Start every node with the same config (the deployment's "
            "parameters and --set values) after the source has stopped changing, then run again")


def main(argv: list[str]) -> int:
    _configure_logging()
    job_arg, error_path = argv[0], Path(argv[1])
    parent = int(argv[2]) if len(argv) > 2 and argv[2] != HOLD_FLAG else None
    hold = HOLD_FLAG in argv
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    stop = StopFlag()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stop.request(signal.Signals(signum).name))
    die_with_parent()
    if parent is not None and not under_torchrun and os.getppid() != parent:
        stop.request("parent process died")
    polling = False
    while True:
        try:
            job = TrainJob.unseal(Sealed.parse(job_arg))
        except RetrainError as err:
            report_error(error_path, ErrorReport(type=type(err).__name__, message=str(err),
                                                 transient=getattr(err, "transient", False)))
            return EXIT_USER_ERROR
        poll = job.config.train.checkpoint.spot_notice_url
        if poll and not polling:
            start_spot_notice_poller(poll, job.config.train.checkpoint.spot_poll_seconds, stop)
            polling = True
        code = _run_job(job, error_path, stop, under_torchrun)
        if not hold or code != 0:
            return code
        emit(Idle())
        order = _next_order(stop, parent)
        if order is None:
            return 0
        job_arg, error_path = order


def _next_order(stop: StopFlag, parent: int | None) -> tuple[str, Path] | None:
    """A warm child's next job (see training.launch.child), or None when it should end: end of file
    on stdin, SIGTERM, or its parent gone."""
    while not stop.requested and (parent is None or os.getppid() == parent):
        ready, _, _ = select.select([sys.stdin], [], [], 0.5)
        if not ready:
            continue
        line = sys.stdin.readline()
        if not line:
            return None
        order = JobOrder.model_validate_json(line)
        # The job's start-up is billed from the hand-over, as a fresh child's is from its spawn.
        os.environ["RETRAIN_SPAWN_TIME"] = repr(order.spawn_time)
        return order.job, Path(order.error)
    return None


def _run_job(job: TrainJob, error_path: Path, stop: StopFlag, under_torchrun: bool) -> int:
    """Train one job; its exit code."""
    rank, world = 0, 1
    if under_torchrun:
        error_path = error_path.with_name(f"{error_path.name}.rank{os.environ.get('RANK', '0')}")
    try:
        _numerics_as_keyed(job)
        rank, world = _init_distributed(job)
        if world > 1 and os.environ.get("LOCAL_RANK", "0") == "0":
            emit(InGroup(node=int(os.environ.get("GROUP_RANK", "0")), rank=rank, world_size=world))
        try:
            result = train(job, stop, emit, rank=rank, world_size=world)
        except MemoryError as err:  # torch.OutOfMemoryError is a RuntimeError: see _out_of_memory
            raise _out_of_memory(job, err) from err
        except RuntimeError as err:
            if "out of memory" not in str(err).lower():
                raise
            raise _out_of_memory(job, err) from err
    except Preempted as err:
        # The parent passes a terminal's Ctrl-C on as SIGINT: the user's stop, not a reclaim.
        kind = "interrupted" if stop.reason == "SIGINT" else "preempted"
        logging.getLogger("training").warning("%s: %s", kind, err)
        return EXIT_PREEMPTED
    except RetrainError as err:
        report = ErrorReport(type=type(err).__name__, message=str(err), transient=getattr(err, "transient", False))
        report_error(error_path, report)
        return EXIT_USER_ERROR
    except Exception as err:
        if world > 1 and _lost_peer(err):
            logging.getLogger("training").warning("rank %d lost a peer: %s", rank, str(err).splitlines()[0])
            report_error(error_path, ErrorReport(type="Preempted", message=f"rank {rank} lost a peer"))
            return EXIT_PREEMPTED
        # A bug: its traceback follows on stderr; the parent names it (and never retries it as
        # if a rank had been preempted).
        report_error(error_path, ErrorReport(type="Bug", message=f"{type(err).__name__}: {err}".splitlines()[0]))
        raise
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    if result is not None:  # rank 0
        emit(Done(status=result.status, steps=result.step if isinstance(result, RungResult) else result.steps))
    return 0


def _out_of_memory(job: TrainJob, err: BaseException) -> ConfigError:
    tc = job.config.train
    return ConfigError(f"training ran out of memory ({type(err).__name__}) at train.batch_size {tc.batch_size}; lower "
                       "train.batch_size (train.grad_accum keeps the effective batch), model.hidden, or set "
                       "train.auto_batch_size: true")


def _exit_distributed(code: int) -> None:
    """End a torchrun rank without interpreter finalization.

    Measured: about 1 run in 10 of two gloo ranks on CPU aborted ("terminate called without an
    active exception", SIGABRT) after `main` had returned and the process group was destroyed:
    a C++ thread still owned by the communication library met its static destructors. torchrun
    then reports the rank as failed, and a finished run would be retried as a preemption. All
    results are on disk and stdout is flushed by now, so nothing is lost by skipping teardown.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    code = main(sys.argv[1:])
    if "TORCHELASTIC_RUN_ID" in os.environ:
        _exit_distributed(code)
    sys.exit(code)
