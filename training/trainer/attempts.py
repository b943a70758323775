"""The attempts ledger of a run: how many training processes were started, and what each found.

The launcher counts a process before it starts (`count_attempt`), so one killed during start-up
is still counted; each process then appends its resume point, the work lost since the last
checkpoint and its start-up time (`append_attempt`, fsynced) before it trains. The report's
preemptions and lost work come from here, never from a checkpoint an attempt may not have
lived to write. Torch-free: the launcher reads it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["append_attempt", "count_attempt", "read_attempts"]


def append_attempt(path: Path, entry: dict[str, Any]) -> list[dict[str, Any]]:
    """Append one attempt's record durably; return every record so far."""
    before = path.read_text() if path.exists() else ""
    torn = bool(before) and not before.endswith("\n")
    line = ("\n" if torn else "") + json.dumps(entry) + "\n"  # never continue a torn line
    with open(path, "a") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())
    entries = []
    for record in (before + line).splitlines():
        try:
            entries.append(json.loads(record))
        except json.JSONDecodeError:
            continue  # a line torn by a kill mid-write
    return entries


def read_attempts(run_dir: Path) -> int:
    """Training processes started for this run (counted by the launcher before each start)."""
    try:
        return int((run_dir / "processes-started").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def count_attempt(run_dir: Path) -> int:
    """Count one more training process, before it starts: an attempt killed during start-up
    (imports, data and checkpoint load) is still a preemption the report must show."""
    count = read_attempts(run_dir) + 1
    tmp = run_dir / f".processes-started.tmp-{os.getpid()}"
    tmp.write_text(str(count))
    os.replace(tmp, run_dir / "processes-started")
    return count
