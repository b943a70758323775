"""Entry point of the training child process: `python -m training.worker JOB.json ERROR.json`.

Exit codes: 0 done, EXIT_PREEMPTED after an emergency checkpoint, EXIT_USER_ERROR with the
error written to ERROR.json. Progress events go to stdout as JSON lines; logs go to stderr.
"""

from __future__ import annotations

import ctypes
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from training.errors import EXIT_PREEMPTED, EXIT_USER_ERROR, Preempted, RetrainError
from training.loop import StopFlag, TrainJob, train
from training.spot import start_spot_notice_poller

__all__ = ["main"]


def _die_with_parent() -> None:
    # If the task process dies first, get SIGTERM rather than train on as an orphan: the
    # handler below then writes an emergency checkpoint. Linux only; elsewhere a no-op.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _emit(event: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="[train] %(levelname)s %(message)s")
    job_path, error_path = Path(argv[0]), Path(argv[1])
    parent = int(argv[2]) if len(argv) > 2 else None
    stop = StopFlag()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stop.request(signal.Signals(signum).name))
    _die_with_parent()
    import os

    if parent is not None and os.getppid() != parent:
        stop.request("parent process died")
    job = TrainJob.load(job_path)
    poll = job.config.get("train", {}).get("spot_notice_url")
    if poll:
        start_spot_notice_poller(poll, float(job.config["train"].get("spot_poll_seconds", 5.0)), stop)
    try:
        result = train(job, stop, _emit)
    except Preempted as err:
        logging.getLogger("training").warning("preempted: %s", err)
        return EXIT_PREEMPTED
    except RetrainError as err:
        error_path.write_text(json.dumps({"type": type(err).__name__, "message": str(err)}))
        return EXIT_USER_ERROR
    _emit({"event": "done", "status": result["status"], "steps": result["steps"]})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
