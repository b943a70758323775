"""Retry conditions, cache policies and result storage shared by the tasks."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.cache_policies import INPUTS, TASK_SOURCE, CachePolicy

from training.errors import Preempted, StorageError

__all__ = ["task_logger", "retry_only_preemptions", "retry_transient", "preprocess_cache_policy", "result_storage_for", "backoff"]


def _exception_of(state: Any) -> BaseException | None:
    if isinstance(state.data, BaseException):
        return state.data
    try:
        state.result(raise_on_failure=True)
    except BaseException as err:  # noqa: BLE001 - we only classify it
        return err
    return None


def retry_only_preemptions(task: Any, task_run: Any, state: Any) -> bool:
    """Retry a preempted training process; never a config error, bad data or a bug."""
    return isinstance(_exception_of(state), Preempted)


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Retry storage and network hiccups; bad data and bugs fail at once."""
    exc = _exception_of(state)
    return isinstance(exc, (Preempted, StorageError, ConnectionError, TimeoutError))


# The default policy includes the flow run id, so it never hits across runs. The inputs carry
# the dataset fingerprint, the preprocessing config and the code version explicitly, because
# TASK_SOURCE hashes only the task's own lines, not the library code it calls.
def preprocess_cache_policy(storage_root: str) -> CachePolicy:
    return (INPUTS + TASK_SOURCE).configure(key_storage=str(_root(storage_root) / "prefect" / "cache-keys"))


def result_storage_for(storage_root: str) -> Path:
    return _root(storage_root) / "prefect" / "results"


def _root(storage_root: str) -> Path:
    # Deployments may say "~/.retrain": expand it here as the stages do, or Prefect would write
    # into a folder literally named "~".
    return Path(storage_root).expanduser().resolve()


def backoff(first_delay: float, retries: int) -> list[float]:
    return [first_delay * 2**i for i in range(max(1, retries))]


def task_logger() -> logging.Logger | logging.LoggerAdapter[logging.Logger]:
    """The Prefect run logger inside a run; a plain logger when a task body is called via .fn()."""
    try:
        return get_run_logger()
    except Exception:  # noqa: BLE001 - prefect raises MissingContextError outside a run
        return logging.getLogger("retrain.tasks")
