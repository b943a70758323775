"""Find and signal the training child process of a run, from outside, as a spot reclaim would."""

from __future__ import annotations

import os
import signal
import struct
import threading
import time
from pathlib import Path


def _worker_pids(run_dir: str, rank: int | None = None) -> list[int]:
    """Training worker processes of `run_dir`; with `rank`, only that torchrun rank's."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            # A forked worker's title is one string (setproctitle), a fresh one's is NUL-separated.
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0") if rank is not None else []
        except OSError:
            continue
        if b"training.worker.train" not in cmdline or run_dir.encode() not in cmdline:
            continue
        if rank is not None and (f"RANK={rank}".encode() not in environ or b"TORCHELASTIC_RUN_ID" not in b" ".join(
                e[:19] for e in environ)):
            continue
        pids.append(int(entry))
    return pids


def descendant_workers(pid: int) -> list[int]:
    """Training worker processes started, directly or not, by process `pid`: a study's warm
    children name only their first job on their command line, so they are found by ancestry."""
    parents: dict[int, int] = {}
    workers = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
        if b"training.worker.train" in cmdline:
            workers.append(int(entry))

    def under(p: int) -> bool:
        while p > 1:
            if p == pid:
                return True
            p = parents.get(p, 0)
        return False

    return [w for w in workers if under(parents.get(w, 0))]


def _step_of(heartbeat: Path) -> int:
    """The step a run's heartbeat file says its training reached; -1 before it has one."""
    try:
        data = heartbeat.read_bytes()
    except FileNotFoundError:
        return -1
    return struct.unpack("<qd", data)[0] if len(data) == 16 else -1


def kill_worker_when(run_dir: str, step: int, sig: signal.Signals = signal.SIGKILL, times: int = 1,
                     rank: int | None = None) -> threading.Thread:
    """Background thread: `times` times, wait for a worker of `run_dir` past `step`, send `sig`."""
    heartbeat = Path(run_dir) / "heartbeat.bin"

    def watch() -> None:
        killed: set[int] = set()
        deadline = time.time() + 300
        while len(killed) < times and time.time() < deadline:
            if _step_of(heartbeat) >= step:
                for pid in _worker_pids(run_dir, rank):
                    if pid not in killed:
                        os.kill(pid, sig)
                        killed.add(pid)
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def kill_node_when(run_dir: str, step: int, node: int, sig: signal.Signals = signal.SIGKILL) -> threading.Thread:
    """Background thread: once the run of `run_dir` is past `step`, send `sig` to every process
    of node `node` of a multi-node job (its torchrun agent and its ranks), as when its machine
    is lost. A node's processes name its own folder, `retrain-node-<node>-...`, on their
    command lines (training.worker.node)."""
    heartbeat = Path(run_dir) / "heartbeat.bin"
    marker = f"retrain-node-{node}-".encode()

    def watch() -> None:
        deadline = time.time() + 300
        while time.time() < deadline:
            if _step_of(heartbeat) >= step:
                for entry in os.listdir("/proc"):
                    try:
                        if entry.isdigit() and marker in Path(f"/proc/{entry}/cmdline").read_bytes():
                            os.kill(int(entry), sig)
                    except OSError:
                        continue
                return
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread
