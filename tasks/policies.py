"""Retry conditions, logging and credentials shared by the tasks."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, TypedDict, cast

from prefect import get_run_logger

from training.config import StorageConfig
from training.errors import Preempted, StorageError
from training.protocol.events import ChildEvent, LogLine, Resumed

__all__ = ["FLOW_TIMEOUTS", "forward_child_event", "task_logger", "retried", "RetryOptions", "retry_only_preemptions", "retry_transient",
           "backoff", "apply_credentials_block", "train_timeout", "HOUR", "TRAIN_TIMEOUT"]

HOUR = 3600.0


@dataclass(frozen=True)
class _FlowTimeouts:
    """Each flow's backstop, so that no hung run holds a worker for ever (a deadlock, a mount that
    stopped answering): each far above what its work takes, and a Failed run says which limit
    ended it."""

    watch: float = 900.0
    plan: float = 6 * HOUR
    predict: float = 24 * HOUR
    retrain: float = 72 * HOUR
    tune: float = 7 * 24 * HOUR


FLOW_TIMEOUTS = _FlowTimeouts()
TRAIN_TIMEOUT = 48 * HOUR  # without a budget; with one, train_timeout()


class RetryOptions(TypedDict):
    """The options of `@task` that make its retries (`retried`)."""

    retries: int
    retry_delay_seconds: int
    retry_condition_fn: Callable[[Any, Any, Any], bool]
    timeout_seconds: float | None


def retried(timeout_seconds: float | None) -> RetryOptions:
    """A stage task's options: two retries of what is transient (retry_transient), and a timeout
    (None: none, for tasks submitted to the task runner's threads, which Prefect cannot interrupt;
    their flow's timeout bounds them)."""
    return {"retries": 2, "retry_delay_seconds": 5, "retry_condition_fn": retry_transient,
            "timeout_seconds": timeout_seconds}


def train_timeout(max_wall_seconds: float | None) -> float:
    """The train task's backstop: twice budget.max_wall_seconds and an hour (the budget itself
    stops the run gracefully, within one validation interval), else TRAIN_TIMEOUT."""
    return TRAIN_TIMEOUT if max_wall_seconds is None else 2 * max_wall_seconds + HOUR


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
    if isinstance(exc, StorageError):
        return exc.transient  # a missing bucket or denied access will not get better
    return isinstance(exc, (Preempted, ConnectionError, TimeoutError))


def backoff(first_delay: float, retries: int) -> list[float]:
    return [first_delay * 2**i for i in range(max(1, retries))]


def task_logger() -> logging.Logger | logging.LoggerAdapter[logging.Logger]:
    """The Prefect run logger inside a run; a plain logger when a task body is called via .fn()."""
    try:
        return get_run_logger()
    except Exception:  # noqa: BLE001 - prefect raises MissingContextError outside a run
        return logging.getLogger("retrain.tasks")


def forward_child_event(logger: logging.Logger | logging.LoggerAdapter[logging.Logger], event: ChildEvent) -> None:
    """The training child's resumes, warnings and errors, into the task run's log (the UI)."""
    if isinstance(event, Resumed):
        logger.info("resumed from step %d (%s)", event.step, event.checkpoint)
    elif isinstance(event, LogLine):
        level = logging.getLevelName(event.level)
        logger.log(level if isinstance(level, int) else logging.WARNING, "%s", event.message)


def apply_credentials_block(storage: StorageConfig) -> None:
    """Hand the credentials of a Prefect AwsCredentials block to boto3 in this process and the
    training processes it starts, through the standard environment variables (never logged)."""
    if not storage.is_s3 or not storage.credentials_block:
        return
    from prefect_aws import AwsCredentials

    try:
        block = cast(AwsCredentials, AwsCredentials.load(storage.credentials_block))  # sync here: the value
    except ValueError:
        raise StorageError(f"storage.credentials_block: no AwsCredentials block named "
                           f"'{storage.credentials_block}'; create it in the Prefect UI or with prefect block create") from None
    values = {
        "AWS_ACCESS_KEY_ID": block.aws_access_key_id,
        "AWS_SECRET_ACCESS_KEY": block.aws_secret_access_key.get_secret_value() if block.aws_secret_access_key else None,
        "AWS_SESSION_TOKEN": block.aws_session_token,
        "AWS_DEFAULT_REGION": block.region_name,
        "AWS_PROFILE": block.profile_name,
    }
    for key, value in values.items():
        if value:
            os.environ[key] = value
