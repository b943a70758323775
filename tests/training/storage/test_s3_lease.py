"""The S3 root's writer lease against a real S3 endpoint (moto's server), with real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from training.storage.s3 import S3Settings, S3Store
from training.storage.lease import LEASE_KEY, S3Lease, hold_s3_root

_HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from training.storage.s3 import S3Settings, S3Store
    from training.storage.lease import hold_s3_root
    store = S3Store(S3Settings(bucket=sys.argv[1], prefix="team", endpoint_url=sys.argv[2]))
    events = Path(sys.argv[3])
    with hold_s3_root(store, on_wait=lambda m: None, ttl_seconds=float(sys.argv[4])):
        with events.open("a") as f:
            f.write(f"start {sys.argv[5]} {time.time()}\\n")
        time.sleep(float(sys.argv[6]))
        with events.open("a") as f:
            f.write(f"end {sys.argv[5]} {time.time()}\\n")
""")


def _store(bucket: str, endpoint: str) -> S3Store:
    return S3Store(S3Settings(bucket=bucket, prefix="team", endpoint_url=endpoint))


def _holder(bucket: str, endpoint: str, events: Path, name: str, hold: float, ttl: float = 30.0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _HOLDER, bucket, endpoint, str(events), str(ttl), name, str(hold)],
                            cwd=Path(__file__).resolve().parents[3])


def _intervals(events: Path) -> dict[str, list[float]]:
    spans: dict[str, list[float]] = {}
    for line in events.read_text().splitlines():
        kind, name, at = line.split()
        spans.setdefault(name, []).append(float(at))
    return spans


@pytest.mark.slow
def test_two_processes_never_hold_one_s3_root_at_once(s3_server: str, s3_bucket: str, tmp_path: Path) -> None:
    events = tmp_path / "events"
    procs = [_holder(s3_bucket, s3_server, events, name, hold=2.0) for name in ("a", "b")]
    for proc in procs:
        assert proc.wait(timeout=120) == 0
    spans = sorted(_intervals(events).values())
    assert len(spans) == 2
    (start_1, end_1), (start_2, end_2) = spans
    assert end_1 <= start_2, "both processes held the root at once"
    assert _store(s3_bucket, s3_server).get_bytes(LEASE_KEY) is None  # released


@pytest.mark.slow
def test_a_killed_holders_lease_is_taken_over_at_once_on_its_machine(
    s3_server: str, s3_bucket: str, tmp_path: Path
) -> None:
    events = tmp_path / "events"
    killed = _holder(s3_bucket, s3_server, events, "killed", hold=600.0, ttl=600.0)
    store = _store(s3_bucket, s3_server)
    deadline = time.time() + 180
    while store.get_bytes(LEASE_KEY) is None:
        assert time.time() < deadline and killed.poll() is None
        time.sleep(0.1)
    killed.kill()
    killed.wait()
    t0 = time.monotonic()
    with hold_s3_root(store, ttl_seconds=600.0):
        waited = time.monotonic() - t0
        body = json.loads(store.get_bytes(LEASE_KEY) or b"{}")
        assert body["pid"] == os.getpid()
    assert waited < 60  # not the 600 s time to live: its holder is known dead


def test_a_lease_from_another_machine_expires_by_the_servers_clock_and_renewal_keeps_one_alive(
    s3_server: str, s3_bucket: str
) -> None:
    store = _store(s3_bucket, s3_server)
    # Another machine's holder that died: only its time to live can free the root.
    store.client.put_object(Bucket=s3_bucket, Key=store.key(LEASE_KEY),
                            Body=json.dumps({"host": "elsewhere", "pid": 1, "ttl_seconds": 2}).encode())
    waits: list[str] = []
    lease = S3Lease(store, ttl_seconds=4.0, poll_seconds=0.2)
    lease.acquire(waits.append)
    assert waits and "elsewhere" in waits[0]  # it waited, and said for whom
    try:
        # Renewed every ttl/3: a second claimant keeps waiting past the time to live. Waited for
        # as renewals (each a new ETag on the lease), not as seconds: on a loaded machine the
        # renewal thread may run late, which a fixed sleep would take for a lost lease.
        rival = S3Lease(store, ttl_seconds=4.0, poll_seconds=0.2)
        assert not rival._put(IfNoneMatch="*")
        seen = [lease.etag]

        def renewed_past_the_ttl() -> bool:
            if lease.etag != seen[-1]:
                seen.append(lease.etag)
            return len(seen) > 3  # three renewals: one time to live after the first hold
        deadline = time.monotonic() + 120
        while not renewed_past_the_ttl():
            assert time.monotonic() < deadline, "the lease was not renewed three times in 120 s"
            time.sleep(0.05)
        current = rival._current()
        assert current is not None and not rival._stale(current[1], current[2])
        assert not rival._put(IfNoneMatch="*") and not lease.lost.is_set()
    finally:
        lease.release()
    assert store.get_bytes(LEASE_KEY) is None


def test_a_later_attempt_of_the_same_flow_run_takes_over_at_once_another_run_waits(
        s3_server: str, s3_bucket: str) -> None:
    store = _store(s3_bucket, s3_server)
    # An attempt on a machine that is gone (another host: its pid tells nothing) held the root.
    store.client.put_object(Bucket=s3_bucket, Key=store.key(LEASE_KEY), Body=json.dumps(
        {"host": "lost-node", "pid": 1, "owner": "flow-run-1", "ttl_seconds": 600}).encode())
    other = S3Lease(store, ttl_seconds=600, poll_seconds=0.1, owner="flow-run-2")
    assert not other._stale(*other._current()[1:])  # another run waits for it
    waits: list[str] = []
    same = S3Lease(store, ttl_seconds=600, poll_seconds=0.1, owner="flow-run-1")
    same.acquire(waits.append)
    try:
        assert waits == []  # taken over without waiting out the 600 s
        assert json.loads(store.get_bytes(LEASE_KEY))["token"] == same.token
    finally:
        same.release()
