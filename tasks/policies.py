"""Retry conditions, cache policies and result storage shared by the tasks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect.cache_policies import INPUTS, TASK_SOURCE, CachePolicy

from training.errors import Preempted

__all__ = ["retry_only_preemptions", "preprocess_cache_policy", "result_storage_for", "backoff"]


def retry_only_preemptions(task: Any, task_run: Any, state: Any) -> bool:
    """Retry a preempted training process; never a config error, bad data or a bug."""
    exc = state.data if isinstance(state.data, BaseException) else None
    if exc is None:
        try:
            state.result(raise_on_failure=True)
        except BaseException as err:  # noqa: BLE001 - we only classify it
            exc = err
    return isinstance(exc, Preempted)


# The default policy includes the flow run id, so it never hits across runs. The inputs carry
# the dataset fingerprint, the preprocessing config and the code version explicitly, because
# TASK_SOURCE hashes only the task's own lines, not the library code it calls.
def preprocess_cache_policy(storage_root: str) -> CachePolicy:
    return (INPUTS + TASK_SOURCE).configure(key_storage=str(Path(storage_root) / "prefect" / "cache-keys"))


def result_storage_for(storage_root: str) -> Path:
    return Path(storage_root) / "prefect" / "results"


def backoff(first_delay: float, retries: int) -> list[float]:
    return [first_delay * 2**i for i in range(max(1, retries))]
