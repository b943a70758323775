"""glibc malloc settings for the process that loads training data: freed memory is kept for reuse
instead of being handed back to the kernel on every free.

Loading a shard allocates and frees arrays of 0.25-16 MB on three threads (the transform's
chunks, Arrow's lookups, the epoch's permutation and gather). With glibc's defaults an array
above its mmap threshold is unmapped when freed, and the heap is trimmed when its free top grows
past the trim threshold: the next shard maps, faults and zeroes the same memory again, and
unmapping memory of a process with threads on several cores interrupts each core (a TLB
shootdown; dear in a VM). The demo's first epoch in a fresh process (7 shards, 1.6M rows, the
2-core VM, 10 interleaved runs each): 269 ms median (227-353) before; 255 ms (207-292) with these
settings alone; 220 ms (210-243) with them and the loader keeping one copy of each shard (its
scratch arrays are reused from shard to shard, see `loader.ShardBatches._prepare`). Either
setting alone is no help: setting one turns glibc's adaptive threshold off, so the trim
threshold alone sends every allocation above 128 kB to mmap (80k page faults against 28k), and
the mmap threshold alone leaves the heap trimmed at 128 kB.

The cost: memory the process freed stays its own (reused by its later allocations), so its
resident size does not shrink after a peak; a training process keeps its shards, model and
optimizer state for its whole life anyway. Measured on the demo: the first epoch's peak is the
same (466-467 MB against 470-473 MB), three epochs' peak 519-526 MB against 473-475 MB. Nothing is changed when malloc is already tuned
through its environment variables (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, ...), or off
glibc.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

__all__ = ["keep_freed_memory"]

_M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 64 << 20  # above a demo shard's largest array (16 MB), below a whole model's state
_TRIM_THRESHOLD = 1 << 30


@functools.cache
def keep_freed_memory() -> bool:
    """Apply the settings once per process; True when glibc took them."""
    if not sys.platform.startswith("linux") or any(k.startswith("MALLOC_") and k.endswith("_") for k in os.environ):
        return False
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return False  # not glibc (musl's mallopt accepts nothing)
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
