"""The local writer lock between real processes: a second writer waits, a killed holder frees it at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from training.storage.lease import LOCK_NAME, hold_root

_HOLD = """
import sys, time
from pathlib import Path
from training.storage.lease import hold_root
with hold_root(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
    (Path(sys.argv[1]) / "done").touch()  # the last thing it does while holding the lock
"""


def _holder(root: Path, seconds: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(root), str(seconds)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[3])
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_writer_waits_for_the_first(tmp_path: Path) -> None:
    holder = _holder(tmp_path, 1.5)
    waits: list[str] = []
    with hold_root(tmp_path, on_wait=waits.append):
        assert (tmp_path / "done").exists()  # got it only once the holder had finished
    holder.wait()
    assert len(waits) == 1 and f"pid {holder.pid}" in waits[0] and str(tmp_path) in waits[0]


def test_a_killed_holder_frees_the_root_at_once(tmp_path: Path) -> None:
    holder = _holder(tmp_path, 600)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    waits: list[str] = []
    with hold_root(tmp_path, on_wait=waits.append):
        pass
    assert waits == []
    assert (tmp_path / LOCK_NAME).exists()


def test_a_free_root_is_taken_without_waiting(tmp_path: Path) -> None:
    waits: list[str] = []
    with hold_root(tmp_path / "new", on_wait=waits.append):
        with open(tmp_path / "new" / LOCK_NAME) as f:
            assert f"\"pid\": {os.getpid()}" in f.read()
    assert waits == []
