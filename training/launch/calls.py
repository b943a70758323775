"""Stage work that needs torch, run in a child process, so that the flow's process does not
import it for that work: evaluation and the champion gate score models, and a promotion exports
one with torch.export. Importing torch costs a flow's process about 2 s of CPU and a few hundred
MB for the rest of its life, and torch.export's imports and tracing about 3 s more, for work
that takes a fraction of that.

Where the machine has no GPU driver, the child is forked from the zygote that training's
children come from (`training.launch.forks`), with torch and torch._dynamo (which torch.export
needs) already imported; elsewhere it is a fresh process.

Protocol: `python -m MODULE REQUEST.json#sha256=HEX ERROR.json PARENT_PID RESULT.json`: the request
sealed (`training.protocol.sealed`), in a folder of this process only. The child writes
its result to RESULT.json and exits 0. A RetrainError goes to ERROR.json, and on stdout as an
`error` event, with exit code EXIT_USER_ERROR; warnings come on stdout as `log` events. The
parent rebuilds the error as the same class of its own hierarchy, so a task's retry policy
judges it as if it had been raised here.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Callable

from pydantic import BaseModel

from training.errors import EXIT_USER_ERROR, Preempted
from training.launch.child import Child
from training.launch.process import child_env, log_child_event, rebuild_error
from training.protocol.events import ChildEvent, ErrorReport, read_event
from training.protocol.sealed import seal_private

__all__ = ["call_in_child"]

_STOP_GRACE_SECONDS = 5.0


def call_in_child(module: str, request: BaseModel, what: str,
                  on_event: Callable[[ChildEvent], None] = log_child_event) -> str:
    """Run `module`'s `main` on `request` in a child process; the text of its result. `what`
    names the work in errors ("the evaluation"). The child's events go to `on_event`."""
    with tempfile.TemporaryDirectory(prefix="retrain-call-") as folder:
        error_path, result_path = Path(folder) / "error.json", Path(folder) / "result.json"
        sealed = seal_private(Path(folder), "request.json", request.model_dump_json().encode())
        command = [sys.executable, "-m", module, sealed.arg(), str(error_path), str(os.getpid()), str(result_path)]
        reported: list[ErrorReport] = []

        def on_line(line: str) -> None:
            event = read_event(line)
            if event is None:
                sys.stderr.write(line)  # a library printing to stdout: passed through
                return
            if isinstance(event, ErrorReport):
                reported.append(event)
            on_event(event)

        child = Child(command, child_env(), hold=False)
        try:
            rc = child.follow(on_line)
        finally:
            # Unwinding without its result (Ctrl-C, the task cancelled): the child goes too.
            child.stop(_STOP_GRACE_SECONDS)
            child.kill_group()
        if rc == 0:
            return result_path.read_text()
        if rc is not None and rc < 0:
            raise Preempted(f"{what} process was killed by {signal.Signals(-rc).name}; run the same command again")
        if rc == EXIT_USER_ERROR and (reported or error_path.exists()):
            raise rebuild_error(reported[-1] if reported else ErrorReport.model_validate_json(error_path.read_text()))
        raise RuntimeError(f"{what} process failed with exit code {rc} (a bug: its traceback is above)")
