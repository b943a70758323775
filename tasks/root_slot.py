"""The storage root's slot in a Prefect global concurrency limit, held under a lease that the
next attempt of the same flow run can release.

A holder that dies (SIGKILL, a lost machine) stops renewing its lease, and the server frees the
slot when the lease lapses. Its flow run is then started again (the shipped automation
reschedules a crashed run), and that attempt would wait out the lapse on a root nobody uses.
So the lease's id is kept on the flow run as a label, server-side (not in the storage root,
which is untrusted), and a restarted attempt releases its own run's lease at once. A lease id is
unique: releasing one that has lapsed, or that a normal exit released, changes nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from prefect import runtime

from tasks.policies import task_logger

__all__ = ["LEASE_LABEL", "LEASE_SECONDS", "root_slot"]

LEASE_LABEL = "retrain.root-lease"

# A holder renews its lease every 45 s. One that dies frees the slot when the lease runs out,
# noticed by the server's repossessor within 15 s more (or at once by its run's next attempt).
LEASE_SECONDS = 60.0


@contextmanager
def root_slot(name: str, root: str) -> Iterator[None]:
    """Hold one slot of the global concurrency limit `name` (it must exist: fail closed), the
    one of storage root `root`."""
    # Prefect's own building blocks of `prefect.concurrency.sync.concurrency`, which does not
    # hand out the lease id this needs.
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder
    from prefect.concurrency._leases import maintain_concurrency_lease
    from prefect.concurrency._sync import acquire_concurrency_slots_with_lease, release_concurrency_slots_with_lease

    log, run = task_logger(), runtime.flow_run.id
    if run and int(runtime.flow_run.run_count or 1) > 1:
        _release_left_lease(uuid.UUID(run))
    holder = ConcurrencyLeaseHolder(type="flow_run", id=uuid.UUID(run)) if run else None
    # Asked without a client timeout: a timeout that fires while the server grants the slot
    # leaves it held by a lease nobody renews, and every later attempt then waits out that
    # lease on a root nobody uses. So whether to say "waiting" is read first.
    busy = _holders(name)
    if busy:
        log.warning("storage root %s is in use by another run (concurrency limit %s); waiting for it. A run that "
                    "died frees it within %.0f s", root, name, LEASE_SECONDS + 15)
    granted = acquire_concurrency_slots_with_lease([name], 1, lease_duration=LEASE_SECONDS, strict=True,
                                                    holder=holder)
    if busy:
        log.info("storage root %s is free: going on", root)
    try:
        if run:
            _label(uuid.UUID(run), str(granted.lease_id))
        # A renewal that fails once (an API blip) must not kill hours of training: it only logs.
        with maintain_concurrency_lease(granted.lease_id, LEASE_SECONDS, raise_on_lease_renewal_failure=False):
            yield
    finally:
        release_concurrency_slots_with_lease(granted.lease_id)


def _release_left_lease(run: uuid.UUID) -> None:
    """Release the lease an earlier attempt of this flow run recorded, if any: that attempt is
    over (Prefect starts a flow run again only once its last attempt has ended)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        left = (client.read_flow_run(run).labels or {}).get(LEASE_LABEL)
        try:
            lease = uuid.UUID(str(left)) if left else None
        except ValueError:
            task_logger().warning("flow run label %s is not a lease id (%r): ignored", LEASE_LABEL, left)
            return
        if lease is not None:
            client.release_concurrency_slots_with_lease(lease)
            task_logger().info("released the storage root slot this flow run's last attempt held (lease %s)", lease)


def _holders(name: str) -> int:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return int(client.read_global_concurrency_limit_by_name(name).active_slots or 0)


def _label(run: uuid.UUID, lease: str) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.update_flow_run_labels(run, {LEASE_LABEL: lease})
