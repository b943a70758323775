"""S3 (or any S3-compatible endpoint) through boto3: uploads, resumable reads, listing, lifecycle.

Every failure leaves here as a one-line `StorageError` that names the bucket and the endpoint
and never the credentials. Single requests are retried by botocore's "standard" retry mode
(connection errors, timeouts, 500/502/503/504, throttling) with exponential backoff, and every
request has connect and read timeouts, so a dead endpoint fails in bounded time. What botocore
does not retry, this module does: a response body that breaks off mid-stream resumes with a
ranged GET from the byte it stopped at (`ResumableObjectReader`), and a multipart upload whose
upload id the server lost (a restart) starts again.
"""

from __future__ import annotations

import builtins
import hashlib
import io
import logging
import os
import random
import re
import time
import urllib.parse
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from training.errors import StorageError

__all__ = ["S3Settings", "S3Store", "ResumableObjectReader", "parse_s3_uri", "object_tags"]

log = logging.getLogger(__name__)

CLASS_TAG = "retrain-class"  # what an object is: drives the lifecycle rules
RUN_TAG = "retrain-run"  # which run wrote it: cost allocation and clean-up
RULE_PREFIX = "retrain:"  # ids of the lifecycle rules this pipeline owns
POOL_CONNECTIONS = 32  # at least the threads that ask at once (training.data.ingest.packing.PLAN_THREADS)


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """("bucket", "prefix") of s3://bucket/prefix (prefix without slashes at the ends)."""
    if not uri.startswith("s3://"):
        raise StorageError(f"{uri!r} is not an s3:// URI")
    bucket, _, prefix = uri[5:].partition("/")
    return bucket, prefix.strip("/")


def object_tags(cls: str, run: str | None, user_tags: dict[str, str]) -> dict[str, str]:
    tags = dict(user_tags)
    tags[CLASS_TAG] = cls
    if run:
        tags[RUN_TAG] = run
    return tags


@dataclass(frozen=True)
class S3Settings:
    """Where and how to talk to the bucket; JSON, so it crosses into the training process.
    Holds no credentials: those come from the standard AWS chain (env, profile, role)."""

    bucket: str
    prefix: str
    endpoint_url: str | None = None
    region: str | None = None
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0
    max_attempts: int = 5
    multipart_bytes: int = 64 << 20

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def endpoint(self) -> str:
        return self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or "AWS S3"


_TRANSIENT_READ = ("ResponseStreamingError", "IncompleteReadError", "ReadTimeoutError", "ProtocolError",
                   "ConnectionClosedError", "EndpointConnectionError", "ConnectTimeoutError")


class S3Store:
    """The objects under s3://bucket/prefix; every key argument is relative to the prefix."""

    def __init__(self, settings: S3Settings) -> None:
        import boto3
        from botocore.config import Config

        self.settings = settings
        self.bucket = settings.bucket
        self.prefix = settings.prefix
        config = Config(
            connect_timeout=settings.connect_timeout_s,
            read_timeout=settings.read_timeout_s,
            retries={"mode": "standard", "max_attempts": settings.max_attempts},
            tcp_keepalive=True,
            # One connection per thread that asks at once (packing plans with PLAN_THREADS; botocore
            # keeps 10 and drops and reopens the rest, logging "Connection pool is full").
            max_pool_connections=POOL_CONNECTIONS,
            # Checksums on what we send; S3 verifies them before it stores the object.
            request_checksum_calculation="when_supported",
            response_checksum_validation="when_supported",
        )
        session = boto3.session.Session()
        self.client = session.client("s3", endpoint_url=settings.endpoint_url, region_name=settings.region, config=config)

    # -- naming and errors ---------------------------------------------------------------------

    def key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def uri(self, rel: str = "") -> str:
        return f"s3://{self.bucket}/{self.key(rel)}" if rel else f"s3://{self.bucket}/{self.prefix}"

    def _error(self, err: BaseException, action: str, rel: str = "") -> StorageError:
        """One line naming the bucket, object and endpoint; never the credentials or a signed URL."""
        where = f"{self.uri(rel)} at endpoint {self.settings.endpoint}"
        code = ""
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        else:
            status = None
        name = type(err).__name__
        code = code or error_code(err)
        if code in ("NoSuchBucket",) or (code == "404" and not rel):
            return StorageError(f"bucket '{self.bucket}' does not exist at endpoint {self.settings.endpoint}; "
                                "create it or fix storage.root")
        if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled") or status == 403:
            return StorageError(f"access denied to {where} while trying to {action} ({code or status}); check the "
                                "credentials and the bucket policy")
        if name == "NoCredentialsError":
            return StorageError(f"no AWS credentials found to {action} {where}; set AWS_ACCESS_KEY_ID/"
                                "AWS_SECRET_ACCESS_KEY, a profile or role, or storage.credentials_block")
        if name in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError"):
            return StorageError(f"cannot reach endpoint {self.settings.endpoint} for bucket '{self.bucket}' after "
                                f"{self.settings.max_attempts} attempts ({name}); check storage.endpoint_url and the network",
                                transient=True)
        if name in ("ReadTimeoutError",):
            return StorageError(f"endpoint {self.settings.endpoint} did not answer within {self.settings.read_timeout_s}s "
                                f"in {self.settings.max_attempts} attempts to {action} {where}", transient=True)
        detail = code or name
        # A server-side failure may pass; a refused request (4xx: no such key, bad request) will not.
        server_side = (isinstance(status, int) and status >= 500) or code.isdigit() and int(code) >= 500
        transient = server_side or code in ("SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable")
        return StorageError(f"cannot {action} {where} ({detail})", transient=transient)

    def _call(self, action: str, rel: str, fn: Any, **kwargs: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(Bucket=self.bucket, **kwargs)
        except (ClientError, BotoCoreError) as err:
            raise self._error(err, action, rel) from None

    # -- bucket ----------------------------------------------------------------------------------

    def check_bucket(self) -> None:
        """Fail fast, and clearly, on a missing bucket, denied access or an unreachable endpoint."""
        self._call("reach the bucket", "", self.client.head_bucket)

    # -- objects ---------------------------------------------------------------------------------

    @staticmethod
    def _tagging(tags: dict[str, str]) -> str:
        return urllib.parse.urlencode(sorted(tags.items()))

    def put_bytes(self, rel: str, data: bytes, tags: dict[str, str], if_absent: bool = False,
                  if_match: str | None = None) -> bool:
        """Write one small object; with `if_absent`, only when no object has that key, with
        `if_match`, only when the object still has that ETag (compare-and-swap). False when S3
        refused the condition."""
        from botocore.exceptions import ClientError

        kwargs: dict[str, Any] = {"Key": self.key(rel), "Body": data, "Tagging": self._tagging(tags),
                                  "ChecksumAlgorithm": "SHA256"}
        if if_absent:
            kwargs["IfNoneMatch"] = "*"
        if if_match is not None:
            kwargs["IfMatch"] = if_match
        conditional = if_absent or if_match is not None
        try:
            self.client.put_object(Bucket=self.bucket, **kwargs)
        except ClientError as err:
            code = err.response.get("Error", {}).get("Code")
            if conditional and code in ("PreconditionFailed", "412", "ConditionalRequestConflict", "NoSuchKey"):
                return False
            raise self._error(err, "write", rel) from None
        except Exception as err:  # noqa: BLE001 - botocore errors, mapped to one line
            raise self._error(err, "write", rel) from None
        return True

    def upload_file(self, rel: str, path: Path, tags: dict[str, str]) -> None:
        """Upload a local file: one PUT below `multipart_bytes`, else a multipart upload in parts
        of that size, each with a SHA256 checksum that S3 checks before it stores the part."""
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(
            multipart_threshold=self.settings.multipart_bytes,
            multipart_chunksize=self.settings.multipart_bytes,
            max_concurrency=4,
            use_threads=True,
        )
        extra = {"Tagging": self._tagging(tags), "ChecksumAlgorithm": "SHA256"}
        for attempt in range(3):
            try:
                self.client.upload_file(str(path), self.bucket, self.key(rel), ExtraArgs=extra, Config=config)
                return
            except Exception as err:  # noqa: BLE001 - botocore and s3transfer errors, classified below
                # Each request was already retried by botocore, with backoff; what reaches here
                # is final, unless the server lost the whole multipart upload (a restart forgets
                # upload ids: NoSuchUpload), which starts over, a bounded number of times.
                if attempt == 2 or "NoSuchUpload" not in f"{error_code(err)} {err}":
                    raise self._error(err, "upload", rel) from None
                log.warning("upload of %s failed (%s); starting it again", self.uri(rel), error_code(err))
                time.sleep((1.0 + random.random()) * (attempt + 1))

    def get_bytes(self, rel: str) -> bytes | None:
        """A small object's bytes, or None when it does not exist."""
        from botocore.exceptions import BotoCoreError, ClientError

        for attempt in range(self.settings.max_attempts):
            try:
                response = self.client.get_object(Bucket=self.bucket, Key=self.key(rel))
                return response["Body"].read()
            except ClientError as err:
                if err.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    return None
                raise self._error(err, "read", rel) from None
            except BotoCoreError as err:
                if type(err).__name__ in _TRANSIENT_READ and attempt + 1 < self.settings.max_attempts:
                    time.sleep(min(4.0, 0.25 * 2**attempt))
                    continue
                raise self._error(err, "read", rel) from None
        raise AssertionError("unreachable")

    def get_versioned(self, rel: str) -> tuple[bytes, str] | None:
        """A small object's bytes and ETag from one response (for a later compare-and-swap)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self.key(rel))
            return response["Body"].read(), str(response["ETag"])
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise self._error(err, "read", rel) from None
        except BotoCoreError as err:
            raise self._error(err, "read", rel) from None

    def head(self, rel: str) -> dict[str, Any] | None:
        from botocore.exceptions import ClientError

        try:
            return self.client.head_object(Bucket=self.bucket, Key=self.key(rel))
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                return None
            raise self._error(err, "look up", rel) from None
        except Exception as err:  # noqa: BLE001
            raise self._error(err, "look up", rel) from None

    def open_reader(self, rel: str, size: int | None = None, start: int = 0) -> ResumableObjectReader:
        """A stream of the object from byte `start` to `size` (its length when None)."""
        if size is None:
            head = self.head(rel)
            if head is None:
                raise StorageError(f"{self.uri(rel)} does not exist at endpoint {self.settings.endpoint}")
            size = int(head["ContentLength"])
        return ResumableObjectReader(self, rel, size, start)

    def get_range(self, rel: str, start: int, length: int) -> bytes:
        """Bytes [start, start + length) of an object: one ranged GET, resumed if it breaks off."""
        out = bytearray(length)
        view = memoryview(out)
        with self.open_reader(rel, start + length, start) as reader:
            done = 0
            while done < length:
                n = reader.readinto(view[done:])
                if n == 0:
                    raise StorageError(f"{self.uri(rel)} ended at byte {start + done}, before byte {start + length}")
                done += n
        return bytes(out)

    def download_file(self, rel: str, dest: Path, size: int | None = None, sha256: str | None = None) -> Path:
        """Stream an object to `dest` (atomically: temp file, then rename), checking its sha256."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.part-{os.getpid()}-{random.getrandbits(32):08x}")
        h = hashlib.sha256()
        try:
            with self.open_reader(rel, size) as reader, open(tmp, "wb") as out:
                while chunk := reader.read(1 << 20):
                    h.update(chunk)
                    out.write(chunk)
            if sha256 is not None and h.hexdigest() != sha256:
                raise StorageError(f"{self.uri(rel)} does not match its sha256 in the manifest; the object is corrupt")
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        return dest

    def list(self, rel_prefix: str) -> dict[str, int]:
        """{relative key: size} of every object under `rel_prefix`."""
        return {rel: size for rel, (size, _) in self.list_objects(rel_prefix).items()}

    def list_objects(self, rel_prefix: str) -> dict[str, tuple[int, str]]:
        """{relative key: (size, ETag)} of every object under `rel_prefix`."""
        return {rel: (size, etag) for rel, (size, etag, _) in self.list_detailed(rel_prefix).items()}

    def list_detailed(self, rel_prefix: str) -> dict[str, tuple[int, str, float]]:
        """{relative key: (size, ETag, last modified as a Unix time)} of every object under `rel_prefix`."""
        out: dict[str, tuple[int, str, float]] = {}
        paginator = self.client.get_paginator("list_objects_v2")
        strip = len(self.key(""))
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.key(rel_prefix)):
                for obj in page.get("Contents", []):
                    modified = obj.get("LastModified")
                    out[obj["Key"][strip:]] = (int(obj["Size"]), str(obj.get("ETag", "")).strip('"'),
                                               modified.timestamp() if modified is not None else 0.0)
        except Exception as err:  # noqa: BLE001 - ClientError/BotoCoreError, mapped to one line
            raise self._error(err, "list", rel_prefix) from None
        return out

    def delete(self, rels: builtins.list[str]) -> None:  # `list` is a method here
        for i in range(0, len(rels), 1000):
            chunk = [{"Key": self.key(r)} for r in rels[i : i + 1000]]
            if chunk:
                self._call("delete from", rels[i], self.client.delete_objects, Delete={"Objects": chunk, "Quiet": True})

    def tags_of(self, rel: str) -> dict[str, str]:
        response = self._call("read the tags of", rel, self.client.get_object_tagging, Key=self.key(rel))
        return {t["Key"]: t["Value"] for t in response["TagSet"]}

    # -- lifecycle -------------------------------------------------------------------------------

    def ensure_lifecycle(self, rules: builtins.list[dict[str, Any]]) -> bool:
        """Make the bucket carry `rules` (ids starting with "retrain:"), keeping every other rule.

        PutBucketLifecycleConfiguration replaces the whole set, so read, merge, write. Rules of
        ours for this prefix are replaced by id; rules of anyone else are left exactly as they
        are. Returns False when the bucket already had them (nothing written).
        """
        from botocore.exceptions import ClientError

        try:
            current = self.client.get_bucket_lifecycle_configuration(Bucket=self.bucket).get("Rules", [])
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") != "NoSuchLifecycleConfiguration":
                raise self._error(err, "read the lifecycle rules of", "") from None
            current = []
        except Exception as err:  # noqa: BLE001
            raise self._error(err, "read the lifecycle rules of", "") from None
        ours = {r["ID"] for r in rules}
        merged = [r for r in current if r.get("ID") not in ours] + rules
        if _canonical(current) == _canonical(merged):
            return False
        self._call("write the lifecycle rules of", "", self.client.put_bucket_lifecycle_configuration,
                   LifecycleConfiguration={"Rules": merged})
        return True


def error_code(err: BaseException) -> str:
    """The S3 error code of a ClientError, or of one wrapped in s3transfer's message."""
    response = getattr(err, "response", None)
    if isinstance(response, dict) and response.get("Error", {}).get("Code"):
        return str(response["Error"]["Code"])
    match = re.search(r"An error occurred \((\w+)\)", str(err))
    return match.group(1) if match else type(err).__name__


def _canonical(rules: list[dict[str, Any]]) -> list[str]:
    import json

    return sorted(json.dumps(r, sort_keys=True, default=str) for r in rules)


class ResumableObjectReader(io.RawIOBase):
    """A read-only stream of one object that survives dropped connections.

    When the body breaks off (reset, timeout, truncated response) it reopens the object with
    `Range: bytes=<offset>-` and goes on from the byte it had reached, so a broken 1 GB shard
    costs one more request, not another gigabyte. Gives up with a StorageError after
    `max_attempts` consecutive failures without progress.
    """

    def __init__(self, store: S3Store, rel: str, size: int, start: int = 0) -> None:
        super().__init__()
        self.store = store
        self.rel = rel
        self.size = size  # the byte to stop before
        self.pos = start
        self.resumes = 0
        self._body: Any = None
        self._failures = 0

    def readable(self) -> bool:
        return True

    def _open(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            kwargs: dict[str, Any] = {"Bucket": self.store.bucket, "Key": self.store.key(self.rel)}
            kwargs["Range"] = f"bytes={self.pos}-{self.size - 1}"  # a part of the object, or the rest of it
            self._body = self.store.client.get_object(**kwargs)["Body"]
        except (ClientError, BotoCoreError) as err:
            raise self.store._error(err, "read", self.rel) from None

    def readinto(self, b: Any) -> int:
        if self.pos >= self.size:
            return 0
        while True:
            try:
                if self._body is None:
                    self._open()
                data = self._body.read(min(len(b), self.size - self.pos))
                if not data:
                    raise ConnectionError(f"body ended at byte {self.pos} of {self.size}")
            except Exception as err:
                if isinstance(err, StorageError):
                    raise
                self._close_body()
                self._failures += 1
                if self._failures >= self.store.settings.max_attempts:
                    raise StorageError(
                        f"reading {self.store.uri(self.rel)} at endpoint {self.store.settings.endpoint} broke off "
                        f"{self._failures} times at byte {self.pos} of {self.size} ({type(err).__name__})",
                        transient=True,
                    ) from None
                self.resumes += 1
                log.warning("read of %s broke off at byte %d (%s); resuming with a ranged GET",
                            self.store.uri(self.rel), self.pos, type(err).__name__)
                time.sleep(min(4.0, 0.2 * 2 ** (self._failures - 1)) * (0.5 + random.random()))
                continue
            n = len(data)
            b[:n] = data
            self.pos += n
            self._failures = 0
            return n

    def _close_body(self) -> None:
        if self._body is not None:
            try:
                self._body.close()
            except Exception:  # noqa: BLE001 - the connection is already broken
                pass
            self._body = None

    def close(self) -> None:
        self._close_body()
        super().close()

