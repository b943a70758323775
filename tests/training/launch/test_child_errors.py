"""An error a child process reports is raised in its parent as the same class of the parent's
own hierarchy, with what decides whether the task retries it."""

from __future__ import annotations

from training.errors import DamagedShard, Preempted, RetrainError, StorageError
from training.protocol.events import ErrorReport
from training.launch.process import rebuild_error


def test_a_reported_error_is_rebuilt_with_its_class_and_whether_a_retry_can_help() -> None:
    transient = rebuild_error(ErrorReport(type="StorageError", message="S3 timed out", transient=True))
    assert type(transient) is StorageError and transient.transient and str(transient) == "S3 timed out"
    lasting = rebuild_error(ErrorReport(type="StorageError", message="no such bucket"))
    assert isinstance(lasting, StorageError) and not lasting.transient
    assert type(rebuild_error(ErrorReport(type="Preempted", message="stopped"))) is Preempted
    assert str(rebuild_error(ErrorReport(type="DamagedShard", message="shard x is damaged"))) == "shard x is damaged"
    assert isinstance(rebuild_error(ErrorReport(type="DamagedShard", message="m")), DamagedShard)
    assert type(rebuild_error(ErrorReport(type="ValueError", message="not ours"))) is RetrainError
