"""Retry conditions, cache policies and result storage shared by the tasks."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.cache_policies import INPUTS, TASK_SOURCE, CachePolicy

from training.config import StorageConfig
from training.errors import Preempted, StorageError

__all__ = ["task_logger", "retry_only_preemptions", "retry_transient", "preprocess_cache_policy", "result_storage_for",
           "backoff", "apply_credentials_block"]


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


# The default policy includes the flow run id, so it never hits across runs. The inputs carry
# the dataset fingerprint, the preprocessing config and the code version explicitly, because
# TASK_SOURCE hashes only the task's own lines, not the library code it calls. The local
# dataset folder and the S3 connection settings are left out: they differ between machines
# that share one root, and the work does not depend on them.
_MACHINE_LOCAL_INPUTS = ("dataset_dir", "storage", "tags")


def preprocess_cache_policy(storage: StorageConfig) -> CachePolicy:
    inputs = INPUTS
    for name in _MACHINE_LOCAL_INPUTS:
        inputs = inputs - name
    return (inputs + TASK_SOURCE).configure(key_storage=_prefect_storage(storage, "cache-keys", save=False))


def result_storage_for(storage: StorageConfig) -> Any:
    """Where task results go: under the root, so a rerun on a fresh machine finds them."""
    return _prefect_storage(storage, "results", save=True)


def _prefect_storage(storage: StorageConfig, folder: str, save: bool) -> Any:
    if not storage.is_s3:
        # Deployments may say "~/.retrain": expand it here as the stages do, or Prefect would
        # write into a folder literally named "~".
        return Path(storage.root).expanduser().resolve() / "prefect" / folder
    from prefect_aws import AwsCredentials, S3Bucket
    from prefect_aws.client_parameters import AwsClientParameters

    from training.s3 import parse_s3_uri

    bucket, prefix = parse_s3_uri(storage.root)
    endpoint = storage.endpoint_url or os.environ.get("AWS_ENDPOINT_URL")
    if storage.credentials_block:
        credentials = AwsCredentials.load(storage.credentials_block)
        if endpoint:
            credentials.aws_client_parameters.endpoint_url = endpoint
    else:
        # No secrets in it: boto3 finds them through the standard chain at use.
        credentials = AwsCredentials(region_name=storage.region,
                                     aws_client_parameters=AwsClientParameters(endpoint_url=endpoint))
    block = S3Bucket(bucket_name=bucket, credentials=credentials,
                     bucket_folder="/".join(p for p in (prefix, "prefect", folder) if p))
    if save:
        # Prefect accepts only saved blocks as result storage; the name is a function of the
        # place, so every run of this root shares one block.
        name = "retrain-results-" + hashlib.sha256(f"{storage.root}|{endpoint}".encode()).hexdigest()[:12]
        block.save(name, overwrite=True)
    return block


def backoff(first_delay: float, retries: int) -> list[float]:
    return [first_delay * 2**i for i in range(max(1, retries))]


def task_logger() -> logging.Logger | logging.LoggerAdapter[logging.Logger]:
    """The Prefect run logger inside a run; a plain logger when a task body is called via .fn()."""
    try:
        return get_run_logger()
    except Exception:  # noqa: BLE001 - prefect raises MissingContextError outside a run
        return logging.getLogger("retrain.tasks")


def apply_credentials_block(storage: StorageConfig) -> None:
    """Hand the credentials of a Prefect AwsCredentials block to boto3 in this process and the
    training processes it starts, through the standard environment variables (never logged)."""
    if not storage.is_s3 or not storage.credentials_block:
        return
    from prefect_aws import AwsCredentials

    try:
        block = AwsCredentials.load(storage.credentials_block)
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
