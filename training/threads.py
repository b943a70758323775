"""How many intra-op threads the training process gives torch (`train.torch_threads`).

torch's default is one thread per core the machine has. On a shared box that oversubscribes:
the training process also runs its shard-prefetch thread (or DataLoader workers), and under
load a default-model step was measured 19x slower with 2 threads than with 1 on a 2-core
machine. So `auto` counts the CPUs this process may really use (its affinity mask, and a
container's CPU quota, which `os.cpu_count()` ignores), shares them among the node's training
processes, and leaves one core per loader thread or worker.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

__all__ = ["ThreadPolicy", "apply_thread_policy", "cgroup_quota", "decide_threads", "usable_cpus"]

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


def usable_cpus(quota: float | None) -> float:
    """CPUs this process may run on: its affinity mask, capped by the container's quota."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return float(min(affinity, quota)) if quota is not None else float(affinity)


def decide_threads(setting: int | Literal["auto"], loader_workers: int, processes_per_node: int = 1,
                   quota: float | None | Literal["read"] = "read") -> ThreadPolicy:
    """The thread count for `setting`: N as given, or for `auto` this process's share of the
    usable CPUs minus what its loader takes (one core for the in-process prefetch thread, or
    one per DataLoader worker), at least one."""
    cpu_quota = cgroup_quota() if quota == "read" else quota
    cpus = usable_cpus(cpu_quota)
    reserved = loader_workers if loader_workers > 0 else 1
    share = max(1, math.floor(cpus / max(1, processes_per_node)))
    threads = setting if setting != "auto" else max(1, share - reserved)
    return ThreadPolicy(setting=setting, threads=threads, usable_cpus=cpus, cpu_quota=cpu_quota,
                        processes_per_node=processes_per_node, reserved=reserved)


def apply_thread_policy(setting: int | Literal["auto"], loader_workers: int) -> ThreadPolicy:
    """Decide for this process (its node's process count from torchrun's LOCAL_WORLD_SIZE) and
    set torch's intra-op threads."""
    import torch  # here: training.results imports ThreadPolicy, and results stay torch-free

    policy = decide_threads(setting, loader_workers, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    torch.set_num_threads(policy.threads)
    return policy
