"""What every child entry point does alike: its events to the parent as JSON lines on stdout,
warnings and errors among them as `log` events, an error both on that pipe and in its file, and
SIGTERM when the parent dies."""

from __future__ import annotations

import ctypes
import logging
import signal
import sys
from pathlib import Path

from training.protocol.events import ChildEvent, ErrorReport, LogLine

__all__ = ["die_with_parent", "emit", "forward_logs", "report_error"]


def emit(event: ChildEvent) -> None:
    sys.stdout.write(event.model_dump_json() + "\n")
    sys.stdout.flush()


class _ToParent(logging.Handler):
    """Log records as `log` events, so they reach the Prefect run's logs (the UI), not only the
    child's terminal."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            emit(LogLine(level=record.levelname, logger=record.name, message=record.getMessage()))
        except Exception:  # noqa: BLE001 - logging must never break the child's work
            self.handleError(record)


def forward_logs(terminal: logging.Handler | None = None) -> None:
    """WARNING and above go to the parent, which logs them into the run: shown once, wherever
    the run is watched. With `terminal`, the records below WARNING go there (stderr)."""
    handlers: list[logging.Handler] = [_ToParent(logging.WARNING)]
    if terminal is not None:
        terminal.addFilter(lambda record: record.levelno < logging.WARNING)
        handlers.insert(0, terminal)
    logging.basicConfig(level=logging.INFO if terminal is not None else logging.WARNING, handlers=handlers,
                        force=True)
    logging.captureWarnings(True)  # Python warnings (e.g. from torch) are log records too


def die_with_parent() -> None:
    """SIGTERM when the process that started this one dies, rather than work on as an orphan:
    a training child's handler then writes its emergency checkpoint, and the parent's retry
    redoes what a stage child was doing. Linux only; elsewhere a no-op."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def report_error(error_path: Path, report: ErrorReport) -> None:
    """An error to the parent: on the event pipe (the only way from another node's rank to the
    launcher, and the disk that holds error_path may be the thing that is full) and in the file."""
    emit(report)
    try:
        error_path.write_text(report.model_dump_json())
    except OSError:
        pass  # a full disk: the event pipe carries it
