"""What the launcher and its zygote say to each other over their socket pair (one JSON message a
datagram): the launcher asks for a child, the zygote answers with its pid and, later, its exit."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, TypeAdapter

__all__ = ["Exited", "Ready", "Refused", "SpawnRequest", "Spawned", "ZYGOTE_MESSAGE", "ZygoteMessage"]


class _Message(BaseModel):
    # Exact on both sides: they are the same version of this code, and a union of models that
    # forbid other keys picks the one message each datagram is.
    model_config = ConfigDict(frozen=True, extra="forbid")


class SpawnRequest(_Message):
    """Fork a child that runs `python -m argv...` in `cwd` with `env`; its stdin, stdout and
    stderr come with the datagram as file descriptors."""

    spawn: int  # the request's number, which the answer names
    argv: list[str]
    env: dict[str, str]
    cwd: str


class Ready(_Message):
    ready: int  # the zygote's pid, once its imports are done


class Refused(_Message):
    refused: str  # why the zygote cannot fork safely; the launcher starts fresh processes instead


class Spawned(_Message):
    spawned: int  # the request's number
    pid: int


class Exited(_Message):
    exited: int  # a child's pid
    returncode: int


ZygoteMessage = Ready | Refused | Spawned | Exited
ZYGOTE_MESSAGE: TypeAdapter[ZygoteMessage] = TypeAdapter(ZygoteMessage)
