"""The one error hierarchy of the pipeline.

    RetrainError            base: a problem the user can fix; the CLI prints it as one line
    ├── ConfigError         the config file, a --set override or a flow parameter is invalid
    ├── DataError           the source Parquet or a packed shard is unusable
    │   └── DamagedShard    a packed shard does not hold what packing writes: packed again
    ├── StorageError        the storage root cannot be read or written
    ├── CheckpointError     a checkpoint is missing, corrupt or belongs to another run
    └── Preempted           the training process was stopped from outside (spot notice,
                            SIGTERM, SIGKILL); transient: the train task retries it

Anything else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations

__all__ = [
    "RetrainError",
    "ConfigError",
    "DataError",
    "DamagedShard",
    "StorageError",
    "CheckpointError",
    "Preempted",
    "EXIT_PREEMPTED",
    "EXIT_USER_ERROR",
]

# Exit codes shared by the training child process and the CLI.
# 75 is EX_TEMPFAIL from sysexits.h: "try again later", which is what a preemption is.
EXIT_PREEMPTED = 75
EXIT_USER_ERROR = 2


class RetrainError(Exception):
    """A problem with the input or environment that the user can fix."""


class ConfigError(RetrainError):
    """Invalid configuration: a key, a value or a combination of them."""


class DataError(RetrainError):
    """The source data or a packed shard is invalid."""


class DamagedShard(DataError):
    """A packed shard's content is not what packing writes (its hash may still match a manifest
    written by the same hand). The dataset is derived data: it is packed again."""

    def __init__(self, path: object, problem: str | None = None) -> None:
        if problem is not None:
            message = (f"shard {path} is damaged: {problem}; run the same command again: the pack stage packs "
                       "the dataset again")
        else:
            message = str(path)  # rebuilt from its message (crossing from the training process)
        super().__init__(message)


class StorageError(RetrainError):
    """The storage root cannot be read or written. `transient`: the network or the endpoint
    failed (worth a task retry); otherwise (no bucket, no access) retrying cannot help."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


class CheckpointError(RetrainError):
    """A checkpoint cannot be used to resume this run."""


class Preempted(RetrainError):
    """Training was stopped from outside; retrying resumes from the last checkpoint."""

    def __init__(self, message: str, *, step: int | None = None) -> None:
        super().__init__(message)
        self.step = step
