"""`storage.root` as one interface, whether it is a local folder or s3://bucket/prefix.

Every stage works on a local folder with the root's layout (see `training.pipeline`). For a
local root that folder *is* the root and publishing is a no-op. For an s3:// root it is a
working copy (`storage.local_dir`, by default ~/.cache/retrain/s3/<bucket>/<prefix>), and:

- `publish(rel, cls)` uploads one file of it, tagged with its object class, the run key and
  the user's cost-allocation tags; folders publish their marker file (manifest, pointer) last;
- `fetch(rel)` brings one object down (`fresh=True` for mutable ones such as the champion
  pointer, which must never come from a stale local copy);
It moves bytes and objects and knows nothing of what they are: dataset layout lives in
`training.data.ingest.dataset_store`, checkpoint layout in `training.trainer.checkpoint_sync`, run layout in
`training.protocol.runs`.

Object classes (the `retrain-class` tag) and their lifecycle: `checkpoint` moves to a colder
class after N days and expires after M; `shard-cache` (packed shards, rebuildable from the
Parquet source) expires; `model` (promoted models), `run` and `cache` objects are kept.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from training.config import LifecycleConfig, StorageConfig
from training.storage.files import inside, write_atomic
from training.storage.s3 import CLASS_TAG, RULE_PREFIX, S3Settings, S3Store, object_tags, parse_s3_uri
from training.copies import updated

__all__ = ["StorageRoot", "StorageSummary", "local_dir_for", "lifecycle_rules", "CHECKPOINT", "SHARD_CACHE", "MODEL", "RUN", "CACHE"]

log = logging.getLogger(__name__)

CHECKPOINT, SHARD_CACHE, MODEL, RUN, CACHE = "checkpoint", "shard-cache", "model", "run", "cache"


def settings_for(storage: StorageConfig) -> S3Settings:
    bucket, prefix = parse_s3_uri(storage.root)
    return S3Settings(
        bucket=bucket,
        prefix=prefix,
        endpoint_url=storage.endpoint_url,
        region=storage.region,
        connect_timeout_s=storage.connect_timeout_s,
        read_timeout_s=storage.read_timeout_s,
        max_attempts=storage.max_attempts,
        multipart_bytes=storage.multipart_mb << 20,
    )


def lifecycle_rules(prefix: str, config: LifecycleConfig) -> list[dict[str, Any]]:
    """The rules this pipeline owns for one root; ids start with "retrain:" and name the prefix."""
    scope = f"{prefix}/" if prefix else ""

    def tagged(cls: str) -> dict[str, Any]:
        tag = {"Key": CLASS_TAG, "Value": cls}
        return {"And": {"Prefix": scope, "Tags": [tag]}} if scope else {"Tag": tag}

    rid = f"{RULE_PREFIX}{prefix or '/'}"[:200]
    return [
        {
            "ID": f"{rid}:checkpoints",
            "Status": "Enabled",
            "Filter": tagged(CHECKPOINT),
            "Transitions": [{"Days": config.checkpoint_transition_days, "StorageClass": config.checkpoint_storage_class}],
            "Expiration": {"Days": config.checkpoint_expire_days},
        },
        {
            "ID": f"{rid}:shard-cache",
            "Status": "Enabled",
            "Filter": tagged(SHARD_CACHE),
            "Expiration": {"Days": config.shard_cache_expire_days},
        },
        {
            # Parts of uploads killed mid-way are billed until aborted.
            "ID": f"{rid}:abort-multipart",
            "Status": "Enabled",
            "Filter": {"Prefix": scope},
            "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": config.abort_multipart_days},
        },
    ]


def local_dir_for(storage: StorageConfig) -> Path:
    """The local folder of a root: the root itself, or the working copy of an s3:// root."""
    if not storage.is_s3:
        return Path(storage.root).expanduser().resolve()
    bucket, prefix = parse_s3_uri(storage.root)
    default = Path("~/.cache/retrain/s3") / bucket / (prefix or "_")
    return Path(storage.local_dir or default).expanduser().resolve()


class StorageSummary(BaseModel):
    """Where a run's files are, as its report says it: never how (no credentials). A bucket is
    checked, and its lifecycle rules ensured, when a run starts (`StorageRoot.prepare`)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    root: str = ""
    remote: bool = False
    endpoint: str | None = None
    local_dir: str | None = None
    shard_cache_gb: float | None = None
    bucket: str | None = None
    lifecycle_updated: bool | None = None  # None: lifecycle not managed, or no bucket
    run_uri: str | None = None  # the run's folder (in a run's report)


class StorageRoot:
    """The root of one pipeline: a local folder, plus an S3 prefix when `storage.root` is s3://."""

    def __init__(self, storage: StorageConfig, tags: dict[str, str] | None = None) -> None:
        self.config = storage
        self.uri = storage.root
        self.user_tags = dict(tags or {})
        self.remote: S3Store | None = None
        if storage.is_s3:
            settings = settings_for(storage)
            self.remote = S3Store(settings)
        self.local = local_dir_for(storage)

    @classmethod
    def from_config(cls, config: Any) -> StorageRoot:
        """From a RetrainConfig (its storage section and cost-allocation tags)."""
        return cls(config.storage, config.cost.tags)

    @property
    def is_remote(self) -> bool:
        return self.remote is not None

    def path(self, rel: str) -> Path:
        """The local path of `rel`: inside the root, or a StorageError (`training.storage.files.inside`)."""
        return inside(self.local, rel)

    def display(self, rel: str) -> str:
        """Where `rel` lives, for reports and logs: its s3:// URI or its local path."""
        return self.remote.uri(rel) if self.remote is not None else str(self.local / rel)

    def tags(self, cls: str, run: str | None = None) -> dict[str, str]:
        return object_tags(cls, run, self.user_tags)

    # -- bucket set-up ----------------------------------------------------------------------------

    def prepare(self) -> StorageSummary:
        """Check the bucket and ensure its lifecycle rules (merged, idempotent); the summary of
        where the run's files are, with what was checked."""
        summary = self.environment_summary()
        if self.remote is None:
            return summary
        self.remote.check_bucket()
        changed = None
        if self.config.lifecycle.manage:
            changed = self.remote.ensure_lifecycle(lifecycle_rules(self.remote.prefix, self.config.lifecycle))
        return updated(summary, {"bucket": self.remote.bucket, "lifecycle_updated": changed})

    # -- single objects ---------------------------------------------------------------------------

    def publish(self, rel: str, cls: str, run: str | None = None) -> None:
        if self.remote is None:
            return
        self.remote.upload_file(rel, self.path(rel), self.tags(cls, run))

    def publish_all(self, rels: list[str], cls: str, run: str | None = None) -> None:
        for rel in rels:
            self.publish(rel, cls, run)

    def fetch(self, rel: str, fresh: bool = False) -> Path | None:
        """The local path of `rel`, downloaded when missing (or always, with `fresh`); None when
        it exists nowhere. Content-addressed objects never change, so their local copy is good."""
        local = self.path(rel)
        if self.remote is None or (local.exists() and not fresh):
            return local if local.exists() else None
        head = self.remote.head(rel)
        if head is None:
            local.unlink(missing_ok=True)  # gone remotely: a stale local copy must not win (fresh)
            return None
        # Streamed to a temp file and renamed: a model package can be gigabytes.
        return self.remote.download_file(rel, local, size=int(head["ContentLength"]))

    def fetch_versioned(self, rel: str) -> tuple[Path | None, str | None]:
        """A small mutable object (the champion pointer), fresh, with its S3 ETag: the version a
        later `publish_if_unchanged` swaps from. Locally the ETag is None (the root's lock
        serializes writers)."""
        local = self.path(rel)
        if self.remote is None:
            return (local if local.exists() else None), None
        got = self.remote.get_versioned(rel)
        if got is None:
            local.unlink(missing_ok=True)
            return None, None
        write_atomic(local, got[0])
        return local, got[1]

    def publish_if_unchanged(self, rel: str, cls: str, run: str | None, etag: str | None) -> bool:
        """Upload `rel` only if the remote object is still the version `etag` names (absent when
        None): compare-and-swap. False when another writer changed it first."""
        if self.remote is None:
            return True
        data = self.path(rel).read_bytes()
        return self.remote.put_bytes(rel, data, self.tags(cls, run), if_absent=etag is None, if_match=etag)

    def environment_summary(self) -> StorageSummary:
        """What the report says about storage: where, never how (no credentials)."""
        if self.remote is None:
            return StorageSummary(root=str(self.local), remote=False)
        return StorageSummary(root=self.uri, remote=True, endpoint=self.remote.settings.endpoint,
                              local_dir=str(self.local), shard_cache_gb=self.config.shard_cache_gb)

