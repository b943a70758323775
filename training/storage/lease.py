"""One writer per S3 storage root, across machines: a lease object written with S3's
conditional writes.

- Taken with `PutObject(IfNoneMatch="*")`: of two machines racing, S3 lets exactly one create it.
- Held by renewing it (`PutObject(IfMatch=<our ETag>)`) every third of its time to live; a
  holder that died stops renewing, and its lease expires.
- Expiry is judged on the S3 server's clock alone (the lease's LastModified against the Date
  header of the same response), so machines with skewed clocks agree on it.
- A stale lease is taken over with `IfMatch=<its ETag>`, so two machines that both saw it
  expire cannot both take it. A lease left by a dead process on this very machine is taken over
  at once: the rerun after a crash does not wait out the time to live.
- Released with `DeleteObject(IfMatch=<our ETag>)`: never someone else's lease.

Prefect's global concurrency limit already serializes runs that share a Prefect server; this
lease covers what it cannot: CLI runs on their own temporary servers, on different machines.
"""

from __future__ import annotations

import email.utils
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from training.errors import StorageError
from training.storage.files import process_alive
from training.storage.s3 import S3Store, error_code

__all__ = ["LEASE_KEY", "LOCK_NAME", "S3Lease", "hold_root", "hold_s3_root"]

log = logging.getLogger(__name__)

LEASE_KEY = ".writer.lease"


def _precondition_failed(err: Exception) -> bool:
    return error_code(err) in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")


class S3Lease:
    def __init__(self, store: S3Store, ttl_seconds: float = 120.0, poll_seconds: float = 5.0,
                 owner: str | None = None) -> None:
        self.store, self.ttl, self.poll, self.owner = store, ttl_seconds, poll_seconds, owner
        self.key = store.key(LEASE_KEY)
        self.token = uuid.uuid4().hex
        self.etag: str | None = None
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def _body(self) -> bytes:
        return json.dumps({"token": self.token, "host": socket.gethostname(), "pid": os.getpid(), "owner": self.owner,
                           "ttl_seconds": self.ttl, "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode()

    def _put(self, **condition: str) -> bool:
        """Write our lease under `condition`; False when S3 refused the condition."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            response = self.store.client.put_object(Bucket=self.store.bucket, Key=self.key, Body=self._body(),
                                                    **condition)
        except ClientError as err:
            if _precondition_failed(err):
                return False
            raise self.store._error(err, "take the storage root's lease", LEASE_KEY) from None
        except BotoCoreError as err:
            raise self.store._error(err, "take the storage root's lease", LEASE_KEY) from None
        self.etag = response["ETag"]
        return True

    def _current(self) -> tuple[str, dict[str, Any], float] | None:
        """(ETag, body, age in seconds by the server's clock) of the lease there, or None."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            response = self.store.client.get_object(Bucket=self.store.bucket, Key=self.key)
            raw = response["Body"].read()
        except ClientError as err:
            if error_code(err) in ("NoSuchKey", "404"):
                return None
            raise self.store._error(err, "read the storage root's lease", LEASE_KEY) from None
        except BotoCoreError as err:
            raise self.store._error(err, "read the storage root's lease", LEASE_KEY) from None
        try:
            body = json.loads(raw)
        except ValueError:
            body = {}  # unreadable: it can only expire
        server_now = email.utils.parsedate_to_datetime(response["ResponseMetadata"]["HTTPHeaders"]["date"])
        age = (server_now - response["LastModified"]).total_seconds()
        return response["ETag"], body if isinstance(body, dict) else {}, age

    def _stale(self, body: dict[str, Any], age: float) -> bool:
        ttl = body.get("ttl_seconds", self.ttl)
        if age > (ttl if isinstance(ttl, (int, float)) else self.ttl):
            return True
        # Left by an earlier attempt of this very flow run: the orchestrator starts a run again
        # only once its previous attempt is over (its container was stopped or lost), so the new
        # attempt takes over at once rather than wait out the time to live.
        if self.owner is not None and body.get("owner") == self.owner:
            return True
        # Left by a process of this machine that is gone: a crash's rerun takes it at once.
        pid = body.get("pid")
        return body.get("host") == socket.gethostname() and isinstance(pid, int) and not process_alive(pid)

    def acquire(self, on_wait: Callable[[str], None]) -> None:
        told = False
        while True:
            if self._put(IfNoneMatch="*"):
                break
            current = self._current()
            if current is None:
                continue  # released between our two requests
            etag, body, age = current
            if self._stale(body, age):
                if self._put(IfMatch=etag):
                    log.warning("took over the storage root's lease %s left by pid %s on %s (%.0f s old)",
                                self.store.uri(LEASE_KEY), body.get("pid", "?"), body.get("host", "?"), age)
                    break
                continue  # someone else took it over first
            if not told:
                on_wait(f"storage root {self.store.uri()} is in use by pid {body.get('pid', '?')} on "
                        f"{body.get('host', '?')} since {body.get('since', '?')}; waiting for it (a holder that "
                        f"died frees it within {self.ttl:.0f} s)")
                told = True
            time.sleep(self.poll)
        self._renewer = threading.Thread(target=self._renew, name="s3-lease", daemon=True)
        self._renewer.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                assert self.etag is not None
                if not self._put(IfMatch=self.etag):
                    self.lost.set()
                    log.error("lost the storage root's lease %s: another run took it over after this one could "
                              "not renew it in time", self.store.uri(LEASE_KEY))
                    return
            except StorageError as err:  # a blip: two more chances before the lease can expire
                log.warning("could not renew the storage root's lease: %s", err)

    def release(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=30)
        if self.etag is None or self.lost.is_set():
            return
        try:
            self.store.client.delete_object(Bucket=self.store.bucket, Key=self.key, IfMatch=self.etag)
        except (ClientError, BotoCoreError) as err:
            # It expires by itself; only a lease we no longer hold is refused here.
            log.warning("could not release the storage root's lease %s (%s)", self.store.uri(LEASE_KEY),
                        error_code(err))


@contextmanager
def hold_s3_root(store: S3Store, on_wait: Callable[[str], None] = lambda message: None,
                 ttl_seconds: float = 120.0, owner: str | None = None) -> Iterator[S3Lease]:
    """Hold the root's lease while the body runs; `owner` (a flow run id) lets a later attempt of
    the same run take over what an earlier, dead attempt held."""
    lease = S3Lease(store, ttl_seconds, owner=owner)
    lease.acquire(on_wait)
    try:
        yield lease
    finally:
        lease.release()


LOCK_NAME = ".writer.lock"


def _holder(handle: int) -> str:
    try:
        raw = os.pread(handle, 4096, 0).decode(errors="replace")
        info = json.loads(raw) if raw.strip() else {}
    except (OSError, ValueError):
        return "another process"
    return f"pid {info.get('pid', '?')} on {info.get('host', '?')} since {info.get('since', '?')}"


@contextmanager
def hold_root(root: Path, on_wait: Callable[[str], None] = lambda message: None) -> Iterator[None]:
    """Hold the root's writer lock for the body; wait (after telling `on_wait` who holds it)
    while another process holds it."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_NAME
    try:
        handle = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise StorageError(f"cannot open the storage root's lock {path}: {err.strerror}; check that the root "
                           f"is writable") from None
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait(f"storage root {root} is in use by {_holder(handle)}; waiting for it to finish")
            fcntl.flock(handle, fcntl.LOCK_EX)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(handle, 0)
        os.pwrite(handle, json.dumps(info).encode(), 0)
        yield
    finally:
        os.close(handle)  # closing drops the lock
