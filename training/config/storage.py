"""`storage`: the storage root (a folder or s3://) and its lifecycle rules."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from training.config.marks import OPERATIONAL
from training.config.section import _Section

__all__ = ["LifecycleConfig", "StorageConfig", "TRANSITION_CLASSES"]

TRANSITION_CLASSES = ("STANDARD_IA", "ONEZONE_IA", "INTELLIGENT_TIERING", "GLACIER_IR", "GLACIER", "DEEP_ARCHIVE")


class LifecycleConfig(_Section):
    manage: bool = Field(True, description="Ensure the bucket's lifecycle rules for this root (merged, idempotent).", json_schema_extra=OPERATIONAL)
    checkpoint_transition_days: int = Field(7, ge=1, description="Days until checkpoints move to a colder class.", json_schema_extra=OPERATIONAL)
    checkpoint_storage_class: str = Field("GLACIER_IR", description="The colder class checkpoints move to.", json_schema_extra=OPERATIONAL)
    checkpoint_expire_days: int = Field(30, ge=1, description="Days until checkpoints are deleted.", json_schema_extra=OPERATIONAL)
    shard_cache_expire_days: int = Field(30, ge=1, description="Days until packed shards (rebuildable) are deleted.", json_schema_extra=OPERATIONAL)
    abort_multipart_days: int = Field(1, ge=1, description="Days until an unfinished multipart upload is aborted.", json_schema_extra=OPERATIONAL)

    @model_validator(mode="after")
    def _order(self) -> LifecycleConfig:
        if self.checkpoint_storage_class not in TRANSITION_CLASSES:
            raise ValueError(
                f"storage.lifecycle.checkpoint_storage_class {self.checkpoint_storage_class!r} is not one of "
                f"{list(TRANSITION_CLASSES)}"
            )
        if self.checkpoint_expire_days <= self.checkpoint_transition_days:
            raise ValueError(
                f"storage.lifecycle.checkpoint_expire_days ({self.checkpoint_expire_days}) must be greater than "
                f"checkpoint_transition_days ({self.checkpoint_transition_days})"
            )
        return self


class StorageConfig(_Section):
    root: str = Field(".retrain", description="Root of datasets, caches, runs and models: a folder or s3://bucket/prefix.", json_schema_extra=OPERATIONAL)
    endpoint_url: str | None = Field(
        None, description="S3-compatible endpoint (MinIO, R2, Ceph). Empty: AWS_ENDPOINT_URL, else AWS S3.", json_schema_extra=OPERATIONAL
    )
    region: str | None = Field(None, description="S3 region. Empty: the AWS configuration's default.", json_schema_extra=OPERATIONAL)
    credentials_block: str | None = Field(
        None, description="Name of a Prefect AwsCredentials block. Empty: the standard AWS credential chain.", json_schema_extra=OPERATIONAL
    )
    local_dir: str | None = Field(
        None, description="Local working copy of an s3:// root. Empty: ~/.cache/retrain/s3/<bucket>/<prefix>.", json_schema_extra=OPERATIONAL
    )
    shard_cache_gb: float = Field(20.0, gt=0, description="Size limit of the local cache of shards read from S3.", json_schema_extra=OPERATIONAL)
    keep_datasets: int = Field(
        3, ge=0, description="Packed datasets kept besides the one a run uses (the newest); segments no kept dataset "
        "lists are removed, here and on S3. A removed dataset is packed again, from its source, if asked for.",
        json_schema_extra=OPERATIONAL)
    multipart_mb: int = Field(64, ge=5, description="Objects above this many MB upload in parts of this size.", json_schema_extra=OPERATIONAL)
    connect_timeout_s: float = Field(5.0, gt=0, description="S3 connect timeout per attempt.", json_schema_extra=OPERATIONAL)
    read_timeout_s: float = Field(30.0, gt=0, description="S3 read timeout per attempt.", json_schema_extra=OPERATIONAL)
    max_attempts: int = Field(5, ge=1, le=20, description="Attempts per S3 request, with exponential backoff.", json_schema_extra=OPERATIONAL)
    heartbeat_seconds: float = Field(
        30.0, gt=0, description="How often a run on an s3:// root records its step on S3, so a resume on a fresh "
        "machine counts the work lost to within this interval. One small PUT each time.", json_schema_extra=OPERATIONAL
    )
    lifecycle: LifecycleConfig = Field(default_factory=LifecycleConfig, json_schema_extra=OPERATIONAL,
                                       description="S3 lifecycle rules by object class (shards, checkpoints, models, runs).")

    @field_validator("root")
    @classmethod
    def _root(cls, v: str) -> str:
        if v.startswith("s3://"):
            bucket, _, prefix = v[5:].partition("/")
            if not bucket:
                raise ValueError(f"storage.root {v!r} names no bucket; write s3://bucket/prefix")
            # The prefix also names the local working copy (~/.cache/retrain/s3/<bucket>/<prefix>):
            # '..' would put it outside the cache.
            if any(part in (".", "..") for part in [bucket, *prefix.split("/")]) or "\\" in v:
                raise ValueError(f"storage.root {v!r}: '.' and '..' are not allowed in an s3:// root; "
                                 f"write the prefix without them")
        elif "://" in v:
            raise ValueError(f"storage.root {v!r}: only local folders and s3:// roots are supported")
        return v

    @property
    def is_s3(self) -> bool:
        return self.root.startswith("s3://")
