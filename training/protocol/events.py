"""What the training process tells its parent, one JSON line each on its stdout: a union of
typed events, told apart by their `event` field. The child writes `event.model_dump_json()`;
the parent reads a line back with `read_event`, the one place a line becomes a model. A line
that is not an event (a user model printing) is passed through as text. Torch-free: the
launcher reads them.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from training.protocol.results import Validation

__all__ = ["ChildEvent", "CheckpointSaved", "Done", "ErrorReport", "Idle", "InGroup", "JobOrder", "LogLine", "NodeJoined", "Paused", "RankDone",
           "Resumed", "Started", "Validated", "read_event"]


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True)


class Validated(_Event):
    """A validation: its metrics, and the run's pace so far (for the ETA and budgets)."""

    event: Literal["validation"] = "validation"
    validation: Validation
    metric: str  # eval.metric of the run
    max_steps: int
    spent_seconds: float

    @property
    def step(self) -> int:
        return self.validation.step

    @property
    def value(self) -> float:
        return self.validation[self.metric]


class Started(_Event):
    """The loop starts (or resumes): the step it starts from and the run's effective step budget
    (a warm start's, a tuning trial's or a plan's calibration's, as the job carries it)."""

    event: Literal["started"] = "started"
    step: int
    max_steps: int
    validate_every: int


class CheckpointSaved(_Event):
    event: Literal["checkpoint"] = "checkpoint"
    step: int
    emergency: bool = False


class Resumed(_Event):
    event: Literal["resumed"] = "resumed"
    step: int
    checkpoint: str


class Paused(_Event):
    """A tuning trial stopped at its rung with a checkpoint."""

    event: Literal["paused"] = "paused"
    step: int
    value: float
    metric: str


class RankDone(_Event):
    """One rank's end of training (DDP: every rank reports what it trained on)."""

    event: Literal["rank_done"] = "rank_done"
    rank: int
    rows: int
    step: int


class Done(_Event):
    event: Literal["done"] = "done"
    status: str
    steps: int


class LogLine(_Event):
    """A warning or error of the training process, for the flow run's log."""

    event: Literal["log"] = "log"
    level: str
    logger: str
    message: str


class ErrorReport(_Event):
    """The error the process exits with: a RetrainError's class and message (mapped to the same
    class in the parent), or "Bug" for anything else."""

    event: Literal["error"] = "error"
    type: str
    message: str
    transient: bool = False  # a StorageError's: the network or the endpoint failed, worth a retry


class NodeJoined(_Event):
    """A node of a multi-node job holds the frozen job and starts torchrun, which goes to the
    rendezvous (see training.launch.group). Started, not yet in the group: `InGroup` says that."""

    event: Literal["node"] = "node"
    node: int
    host: str
    endpoint: str


class InGroup(_Event):
    """A node's first rank is in the process group: the rendezvous admitted its node (torchrun's
    GROUP_RANK), so the launcher counts the nodes that are really training."""

    event: Literal["in_group"] = "in_group"
    node: int
    rank: int
    world_size: int


class Idle(_Event):
    """A warm child finished its job and waits for the next (see training.launch.child)."""

    event: Literal["idle"] = "idle"


ChildEvent = Annotated[Union[Started, Validated, CheckpointSaved, Resumed, Paused, RankDone, Done, LogLine, ErrorReport, NodeJoined,
                             InGroup, Idle],
                       Field(discriminator="event")]
_ADAPTER: TypeAdapter[ChildEvent] = TypeAdapter(ChildEvent)


def read_event(line: str) -> ChildEvent | None:
    """The event a line holds, or None for any other line."""
    try:
        return _ADAPTER.validate_json(line)
    except ValidationError:
        return None


class JobOrder(BaseModel):
    """The other direction: the parent hands a warm child its next job, one JSON line on stdin."""

    job: str  # the job's seal, PATH#sha256=HEX (training.protocol.sealed)
    error: str
    spawn_time: float  # the job's start-up is billed from the hand-over

