"""How many intra-op threads the training process gives torch (`train.loader.torch_threads`).

torch's default is one thread per core the machine has. On a shared box that oversubscribes:
the training process also runs its shard-prefetch thread (or DataLoader workers), and under
load a default-model step was measured 19x slower with 2 threads than with 1 on a 2-core
machine. So `auto` counts the CPUs this process may really use (its affinity mask, and a
container's CPU quota, which `os.cpu_count()` ignores), shares them among the node's training
processes, takes out what other processes on this machine keep busy, and leaves a core to the
loader where it needs one: one per DataLoader worker, and one for the in-process prefetch
thread only when that thread is measured busy (fetching a batch takes half a step or more).
Leaving a core to a prefetch thread that is idle 99 % of the time cost 16.6 % against torch's
default threads on an idle 2-core box.

"Other processes" is measured, not guessed: /proc/stat's busy time on this process's CPUs over
the Trainer's set-up, less this process's own CPU time. The count is decided once per run and
kept in the checkpoint, so a resume computes with the same threads.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict
from training.copies import updated

__all__ = ["CpuClock", "ThreadPolicy", "apply_thread_policy", "cgroup_quota", "decide_threads", "usable_cpus"]

PROC_STAT = Path("/proc/stat")
MIN_WINDOW_SECONDS = 0.25
LOADER_BUSY_FOR_A_CORE = 0.5  # the prefetch thread's busy fraction above which it keeps a core

CGROUP_V2 = Path("/sys/fs/cgroup/cpu.max")
CGROUP_V1 = (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))


class ThreadPolicy(BaseModel):
    """What was decided, as `report.json` records it."""

    model_config = ConfigDict(frozen=True)

    setting: int | Literal["auto"]
    threads: int  # torch.set_num_threads
    usable_cpus: float  # affinity and CPU quota
    cpu_quota: float | None  # the container's quota in CPUs, None without one
    processes_per_node: int
    reserved: int  # cores left to the loader: its prefetch thread, or its worker processes
    others_busy: float = 0.0  # cores other processes kept busy while this one set up
    loader_busy: float | None = None  # fetch time / step time of in-process loading, when probed
    kept_from_checkpoint: bool = False  # a resume: the first attempt's count


def cgroup_quota(v2: Path = CGROUP_V2, v1: tuple[Path, Path] = CGROUP_V1) -> float | None:
    """The CPU quota of this container in CPUs (e.g. 1.5), or None when it has none."""
    try:
        quota, period = v2.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us, period_us = int(v1[0].read_text()), int(v1[1].read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


def _busy_ticks(cpus: set[int], stat: Path = PROC_STAT) -> int | None:
    """Busy clock ticks (everything but idle and iowait) of `cpus` since boot; None off Linux."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    busy = 0
    for line in lines:
        name, *values = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            ticks = [int(v) for v in values[:8]]  # user nice system idle iowait irq softirq steal
            busy += sum(ticks) - ticks[3] - ticks[4]
    return busy


@dataclass(frozen=True)
class CpuClock:
    """A reading of this machine's busy CPU time and this process's own: two readings give the
    cores other processes kept busy in between."""

    wall: float
    busy_ticks: int | None
    own_seconds: float

    @classmethod
    def read(cls) -> CpuClock:
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
        return cls(time.monotonic(), _busy_ticks(cpus), time.process_time())

    @classmethod
    def read_after(cls, earlier: CpuClock, window: float = MIN_WINDOW_SECONDS) -> CpuClock:
        """A reading at least `window` seconds after `earlier` (it waits for the rest): /proc/stat
        counts in 10 ms ticks, so a shorter window cannot tell one busy core from none."""
        time.sleep(max(0.0, earlier.wall + window - time.monotonic()))
        return cls.read()

    def others_busy_since(self, earlier: CpuClock) -> float:
        """Cores kept busy by other processes between `earlier` and this reading (0 when
        unknown)."""
        wall = self.wall - earlier.wall
        if self.busy_ticks is None or earlier.busy_ticks is None or wall <= 0:
            return 0.0
        busy = (self.busy_ticks - earlier.busy_ticks) / os.sysconf("SC_CLK_TCK")
        return max(0.0, (busy - (self.own_seconds - earlier.own_seconds)) / wall)


def usable_cpus(quota: float | None) -> float:
    """CPUs this process may run on: its affinity mask, capped by the container's quota."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return float(min(affinity, quota)) if quota is not None else float(affinity)


def decide_threads(setting: int | Literal["auto"], loader_workers: int, processes_per_node: int = 1,
                   quota: float | None | Literal["read"] = "read", others_busy: float = 0.0,
                   loader_busy: float | None = None) -> ThreadPolicy:
    """The thread count for `setting`: N as given, or for `auto` this process's share of the
    CPUs that other processes leave free, minus what its loader takes: one core per DataLoader
    worker; one for the in-process prefetch thread when `loader_busy` (fetch / step time) is
    LOADER_BUSY_FOR_A_CORE or more, or unknown; at least one thread.

    `others_busy` counts only for a lone process: a node's ranks start together, and each
    would count the others' start-up as load."""
    cpu_quota = cgroup_quota() if quota == "read" else quota
    cpus = usable_cpus(cpu_quota)
    if processes_per_node > 1:
        others_busy = 0.0
    # Whole cores; other processes count from half a core up (below that it is noise: a shell,
    # a log shipper).
    free = math.floor(cpus - others_busy + 0.5) if others_busy >= 0.5 else math.floor(cpus)
    if loader_workers > 0:
        reserved = loader_workers
    else:
        reserved = 1 if loader_busy is None or loader_busy >= LOADER_BUSY_FOR_A_CORE else 0
    share = max(1, free // max(1, processes_per_node))
    threads = setting if setting != "auto" else max(1, share - reserved)
    return ThreadPolicy(setting=setting, threads=threads, usable_cpus=cpus, cpu_quota=cpu_quota,
                        processes_per_node=processes_per_node, reserved=reserved,
                        others_busy=round(others_busy, 3), loader_busy=loader_busy)


def apply_thread_policy(setting: int | Literal["auto"], loader_workers: int, others_busy: float = 0.0,
                        loader_busy: float | None = None, kept: int | None = None) -> ThreadPolicy:
    """Decide for this process (its node's process count from torchrun's LOCAL_WORLD_SIZE) and
    set torch's intra-op threads. `kept`: the count an earlier attempt of this run decided,
    which `auto` keeps."""
    import torch  # here: training.protocol.results imports ThreadPolicy, and results stay torch-free

    policy = decide_threads(setting, loader_workers, int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                            others_busy=others_busy, loader_busy=loader_busy)
    if kept is not None and setting == "auto":
        policy = updated(policy, {"threads": kept, "kept_from_checkpoint": True})
    torch.set_num_threads(policy.threads)
    return policy
