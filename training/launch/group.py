"""The nodes of a multi-node training job, started by TorchX from one frozen job.

With `train.distributed.nnodes` above 1 the train task is the job's launcher, not one of its
nodes:

1. It freezes the job it built (config, dataset, statistics, run key, and the digests of the
   root's files it names) into `runs/<key>/node-job.json` on the storage root
   (`publish_frozen_job`).
2. It starts `nnodes` copies of `python -m training.worker.node RUN_KEY REL --job-sha256 HEX` as one
   TorchX app on `train.distributed.scheduler`: processes on this machine (`local_cwd`), or one
   Volcano job on Kubernetes, gang-scheduled (`kubernetes`). Each node downloads the frozen
   job, refuses one whose bytes are not the ones the launcher published (the digest comes on its
   command line, from TorchX's app, never from the root), and runs its ranks under torchrun at the c10d
   rendezvous on the first node (`--rdzv-id` = the run key, `--nnodes` min:max,
   `join_timeout`, `--max-restarts`). No node lists the source, packs, fits or writes the
   root's shared files; global rank 0 writes the run's own files, as on one node.
3. It follows every node's output: progress and errors of any rank reach the flow's log, and
   it says how many nodes have come to the rendezvous.
4. It tears the app down when it ends, whatever ended it; the task's retry starts every node
   again, and the ranks resume from the last checkpoint on the root.

Why TorchX: it is PyTorch's own launcher of multi-node jobs on schedulers; the same app runs as
local processes (so the suite runs a real two-node job) and on Kubernetes through Volcano's Job,
all pods admitted together; and it adds no rendezvous of its own: torchrun's c10d does that.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from pydantic import BaseModel, ConfigDict

import training
from training.errors import ConfigError, Preempted
from training.launch.process import error_class, free_loopback_port, log_child_event, rebuild_error
from training.protocol.entries import NODE_MODULE
from training.protocol.events import ChildEvent, Done, ErrorReport, InGroup, LogLine, NodeJoined, read_event
from training.protocol.job import TrainJob
from training.protocol.results import TrainResult
from training.protocol.runs import count_attempt, fetch_finished_run
from training.protocol.sealed import seal
from training.storage.files import process_alive
from training.storage.root import RUN, StorageRoot

if TYPE_CHECKING:
    from torchx.runner import Runner
    from torchx.specs import AppDef

__all__ = ["FROZEN_JOB", "NODE_MODULE", "STORAGE_ENV", "FrozenJob", "node_app", "publish_frozen_job", "run_group",
           "scheduler_cfg"]

log = logging.getLogger(__name__)

STORAGE_ENV = "RETRAIN_NODE_STORAGE"  # the storage section, as JSON: where a node finds the frozen job
PID_DIR_ENV = "RETRAIN_NODE_PID_DIR"  # local nodes: where each writes its process id, to be waited for
FROZEN_JOB = "node-job.json"
ROLE = "node"
# Passed on to Kubernetes nodes when the flow's process has them (a pod spec never gets the
# flow's whole environment: it may hold credentials).
PASSED_ENV = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_DEBUG", "AWS_REGION", "AWS_DEFAULT_REGION")
_POLL_SECONDS = 0.5
_TERM_GRACE_SECONDS = 60.0  # for a node's ranks to write the emergency checkpoint after SIGTERM
# Beyond train.distributed.join_timeout_s, for a node's process to start torchrun (imports, the
# frozen job and its data's markers brought down) before the rendezvous's own clock starts.
START_GRACE_SECONDS = 60.0


class FrozenJob(BaseModel):
    """`runs/<key>/node-job.json`: the job every node trains, as the train task built it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_key: str
    local_root: str  # the publisher's local folder of the root: the job's paths lie under it
    job: TrainJob


def publish_frozen_job(job: TrainJob) -> tuple[str, str]:
    """Write the job under its run key on the root (uploaded, on S3): its root-relative path,
    and the sha256 of its bytes, which each node gets on its command line and checks."""
    root = StorageRoot.from_config(job.config)
    rel = f"{job.run_rel or Path(job.run_dir).relative_to(root.local).as_posix()}/{FROZEN_JOB}"
    job.pin_inputs()
    frozen = FrozenJob(run_key=job.run_key, local_root=str(root.local), job=job)
    sealed = seal(root.path(rel), frozen.model_dump_json(indent=1).encode())
    root.publish(rel, RUN, job.run_key)
    return rel, sealed.sha256


def _torchx() -> None:
    try:
        import torchx.runner  # noqa: F401
    except ImportError:
        raise ConfigError("train.distributed.nnodes > 1 starts the nodes through TorchX, which is not installed: "
                          "pip install -c constraints.txt -e '.[scale-out]'") from None


def node_app(job: TrainJob, rel: str, port: int, job_sha256: str, pid_dir: Path | None = None) -> AppDef:
    """The TorchX app of the job's nodes: one role of `nnodes` replicas (the first
    `min_nnodes` required), each running the node entry point on the frozen job at `rel`,
    whose sha256 it must have."""
    from torchx import specs

    d = job.config.train.distributed
    local = d.scheduler == "local_cwd"
    env = {STORAGE_ENV: job.config.storage.model_dump_json(), "PYTHONUNBUFFERED": "1"}
    if local:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(training.__file__).resolve().parent.parent),
                                                         os.environ.get("PYTHONPATH")) if p)
        env.setdefault("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
        if pid_dir is not None:
            env[PID_DIR_ENV] = str(pid_dir)
    else:
        env.update({name: os.environ[name] for name in PASSED_ENV if name in os.environ})
    k8s = d.kubernetes
    role = specs.Role(
        name=ROLE,
        image=os.getcwd() if local else str(k8s.image),
        entrypoint=sys.executable if local else "python",
        args=["-m", NODE_MODULE, job.run_key, rel, "--job-sha256", job_sha256, "--node", specs.macros.replica_id,
              "--rank0-env", specs.macros.rank0_env, "--port", str(port)],
        env=env,
        num_replicas=d.nnodes,
        min_replicas=d.min_nnodes,
        resource=specs.Resource(cpu=k8s.cpu, gpu=k8s.gpu, memMB=k8s.memory_mb),
        port_map={"c10d": port},
        max_retries=0,  # a lost node ends the attempt; the task's retry starts all of them
    )
    if not local and (k8s.node_selector or k8s.tolerations):
        from torchx.specs.overlays import set_overlay

        set_overlay(role, "kubernetes", "V1Pod", {"spec": {"nodeSelector": dict(k8s.node_selector),
                                                           "tolerations": list(k8s.tolerations)}})
    return specs.AppDef(name=f"retrain-{job.run_key[:12]}", roles=[role])


def scheduler_cfg(job: TrainJob, log_dir: Path | None = None) -> dict[str, Any]:
    """TorchX's settings of the job's scheduler."""
    d = job.config.train.distributed
    if d.scheduler == "local_cwd":
        return {"log_dir": str(log_dir)} if log_dir is not None else {}
    k8s = d.kubernetes
    cfg: dict[str, Any] = {"queue": k8s.queue, "namespace": k8s.namespace}
    if k8s.service_account:
        cfg["service_account"] = k8s.service_account
    if k8s.priority_class:
        cfg["priority_class"] = k8s.priority_class
    return cfg


class _Watch:
    """Follows every node's output in threads: events to `on_event` (one at a time), error
    reports kept, and the nodes that reached the rendezvous counted."""

    def __init__(self, runner: Runner, handle: str, job: TrainJob, on_event: Callable[[ChildEvent], None]) -> None:
        self.runner, self.handle, self.job, self.on_event = runner, handle, job, on_event
        self.reported: list[ErrorReport] = []
        self.started: set[int] = set()  # nodes whose torchrun started
        self.in_group: set[int] = set()  # nodes the rendezvous admitted (their first rank is in the group)
        self.failed = threading.Event()  # a rank reported a user error or a bug: stop the others now
        self.done = threading.Event()  # rank 0 finished the run
        self._lock = threading.Lock()
        # Each thread runs in a copy of this context: `on_event` logs to the task run, whose
        # Prefect settings (the server's address) live in context variables.
        self.threads = [threading.Thread(target=contextvars.copy_context().run, args=(self._follow, k), daemon=True)
                        for k in range(job.config.train.distributed.nnodes)]
        for thread in self.threads:
            thread.start()

    def _follow(self, k: int) -> None:
        from torchx.schedulers.api import Stream

        while True:
            try:
                for line in self.runner.log_lines(self.handle, ROLE, k, should_tail=True, streams=Stream.STDOUT):
                    self._line(line)
                return
            except Exception as err:  # noqa: BLE001 - a pod not started yet, its log not there yet
                status = self.runner.status(self.handle)
                if status is None or status.is_terminal():
                    log.debug("node %d's output ended: %s", k, err)
                    return
                time.sleep(2.0)

    def _line(self, line: str) -> None:
        event = read_event(line.rstrip("\n"))
        if event is None:
            if line.strip():
                sys.stderr.write(line if line.endswith("\n") else line + "\n")
            return
        with self._lock:
            n = self.job.config.train.distributed.nnodes
            if isinstance(event, NodeJoined):
                self.started.add(event.node)
                self.on_event(_info(f"node {event.node} ({event.host}) started torchrun, joining the rendezvous at "
                                    f"{event.endpoint}"))
            elif isinstance(event, InGroup):
                self.in_group.add(event.node)
                self.on_event(_info(f"node {event.node} is in the group (rank {event.rank} of {event.world_size}): "
                                    f"{len(self.in_group)} of {n} nodes"))
            elif isinstance(event, ErrorReport):
                self.reported.append(event)
                if event.type == "Bug" or error_class(event) is not Preempted:
                    self.failed.set()
            else:
                if isinstance(event, Done):
                    self.done.set()
                self.on_event(event)

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def _wait_for_nodes(pid_dir: Path, grace: float = _TERM_GRACE_SECONDS) -> None:
    """Wait for the nodes of this machine (their process ids in `pid_dir`) to end, up to
    `grace` seconds; then kill what is left of them (each node is a process group)."""
    pids = []
    for path in pid_dir.glob("node-*.pid"):
        with contextlib.suppress(OSError, ValueError):
            pids.append(int(path.read_text()))
    deadline = time.monotonic() + grace
    while pids and time.monotonic() < deadline:
        for pid in [p for p in pids if _stopped(p)]:  # SIGSTOPped: it cannot act on SIGTERM, nor write anything
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
        pids = [pid for pid in pids if _alive(pid)]
        time.sleep(_POLL_SECONDS)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


def _stopped(pid: int) -> bool:
    """A node process stopped by a signal (SIGSTOP, a debugger): state T in /proc."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[-1].startswith(("T", "t"))
    return False


def _alive(pid: int) -> bool:
    """A node process that has not ended; an ended child of this process stays a zombie until
    TorchX reaps it, which counts as ended."""
    stat = Path(f"/proc/{pid}/stat")
    with contextlib.suppress(OSError):
        if stat.read_text().rsplit(") ", 1)[-1].startswith("Z"):
            return False
    return process_alive(pid)


def _info(message: str) -> LogLine:
    """A line for the flow run's log: the launcher's own, told as the nodes' lines are."""
    return LogLine(level="INFO", logger=__name__, message=message)


def run_group(job: TrainJob, on_event: Callable[[ChildEvent], None] = log_child_event) -> TrainResult:
    """Train `job` on `train.distributed.nnodes` nodes started through TorchX; its result, or
    Preempted (a lost node: the retry starts all of them again) or the error a rank raised."""
    _torchx()
    from torchx.runner import get_runner

    d = job.config.train.distributed
    run_dir = Path(job.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    rel, job_sha256 = publish_frozen_job(job)
    port = free_loopback_port() if d.scheduler == "local_cwd" else d.rdzv_port
    log_dir = run_dir / "nodes" / uuid.uuid4().hex[:8] if d.scheduler == "local_cwd" else None
    count_attempt(run_dir)
    with get_runner() as runner:
        handle = runner.run(node_app(job, rel, port, job_sha256, log_dir), scheduler=d.scheduler, cfg=scheduler_cfg(job, log_dir))
        least = d.min_nnodes or d.nnodes
        on_event(_info(f"started {d.nnodes} nodes of run {job.run_key[:12]} on {d.scheduler} ({handle}): waiting for "
                       f"{f'{least} to {d.nnodes}' if least < d.nnodes else f'all {d.nnodes}'} at the c10d rendezvous "
                       f"on port {port} (up to {int(d.join_timeout_s)} s)"))
        watch = _Watch(runner, handle, job, on_event)
        state, why = "UNKNOWN", ""
        try:
            state, why = _follow(runner, handle, watch, least, time.monotonic() + d.join_timeout_s + START_GRACE_SECONDS)
        finally:
            if state != "SUCCEEDED":
                # SIGTERM to every node (pods deleted on Kubernetes): their ranks write the
                # emergency checkpoint. Nodes on this machine are waited for, so that a retry
                # never meets this attempt's ranks still writing; a stopped node is killed.
                runner.cancel(handle)
                if log_dir is not None:
                    _wait_for_nodes(log_dir)
            watch.join(timeout=30.0)
            if d.scheduler == "kubernetes":
                # TorchX's cancel marks a Volcano job Aborted and leaves it: one would pile up per attempt.
                with contextlib.suppress(Exception):
                    runner.delete(handle)
            if log_dir is not None:
                _remove_node_homes(log_dir)
    return _outcome(job, state, watch.reported, log_dir, why)


def _follow(runner: Runner, handle: str, watch: _Watch, least: int, join_deadline: float) -> tuple[str, str]:
    """Follow the app until it ends, a rank reports its own error, rank 0 finishes (a node that
    never joined may still hold its process), or the group cannot form: a node's process ended
    before the fewest nodes were in the group, or they were not in by `join_deadline`. (The
    state, and why the attempt ends when it is not the app's own end.)"""
    while True:
        status = runner.status(handle)
        if status is not None and status.is_terminal():
            return status.state.name, ""
        if watch.failed.is_set():
            return "STOPPED", ""  # a rank's own error: the others would wait out the rendezvous
        if watch.done.is_set():
            return "FINISHED", ""  # the run is complete on the nodes that trained it
        if len(watch.in_group) < least:
            ended = sorted(r.id for role in (status.roles if status is not None else []) for r in role.replicas
                           if r.state.name in ("FAILED", "CANCELLED", "SUCCEEDED"))
            every = set(range(watch.job.config.train.distributed.nnodes))
            # The culprits: nodes that never started torchrun, else those the rendezvous never admitted.
            missing = sorted(every - watch.started) or sorted(every - watch.in_group)
            if ended:
                return "LOST", (f"node {ended[0]} ended before {least} nodes were in the group; not in it: "
                                f"{_nodes(missing)} (stopped or lost?)")
            if time.monotonic() > join_deadline:
                return "LOST", (f"{_nodes(missing)} did not come to the rendezvous within "
                                f"{watch.job.config.train.distributed.join_timeout_s:.0f} s of its start (stopped, "
                                "unschedulable or lost?)")
        time.sleep(_POLL_SECONDS)


def _nodes(nodes: list[int]) -> str:
    return ("node " if len(nodes) == 1 else "nodes ") + ", ".join(str(n) for n in nodes)


def _remove_node_homes(pid_dir: Path) -> None:
    """The working folders the nodes on this machine made for themselves (training.worker.node)."""
    import shutil

    for path in pid_dir.glob("node-*.home"):
        with contextlib.suppress(OSError, ValueError):
            home = Path(path.read_text().strip())
            if home.name.startswith("retrain-node-"):
                shutil.rmtree(home, ignore_errors=True)


def _finished(job: TrainJob) -> TrainResult | None:
    """The run's result when the nodes finished it (whatever TorchX says of a node that never
    joined), else None."""
    root = StorageRoot.from_config(job.config)
    if root.is_remote:
        with contextlib.suppress(Exception):
            fetch_finished_run(root, job.run_rel)
    path = Path(job.run_dir) / "result.json"
    try:
        result = TrainResult.model_validate_json(path.read_bytes())
    except (OSError, ValueError):
        return None
    return result if result.run_key == job.run_key else None


def _outcome(job: TrainJob, state: str, reported: list[ErrorReport], log_dir: Path | None, why: str = "") -> TrainResult:
    where = f"; each node's output is in {log_dir}" if log_dir is not None else ""
    if state in ("SUCCEEDED", "FINISHED") or not any(r.type == "Bug" or error_class(r) is not Preempted
                                                      for r in reported):
        done = _finished(job)
        if done is not None:
            return done  # complete, even where a node that never joined made the app look lost
    if state in ("SUCCEEDED", "FINISHED"):
        raise Preempted(f"the nodes of run {job.run_key} ended without its result.json{where}; retrying")
    for report in reported:
        if report.type == "Bug":
            raise RuntimeError(f"training job {job.run_key} failed on a node: {report.message}{where}")
    for report in reported:
        if error_class(report) is not Preempted:
            raise rebuild_error(report)
    cause = f": {why}" if why else f" (TorchX state {state})"
    raise Preempted(f"training job {job.run_key} lost a node{cause}; every node starts again on retry{where}")
