"""Shards of S3-backed datasets, on demand, through a size-limited local cache.

A folder of shards (a segment's, or a format-1 dataset's) that holds `remote.json` (written by
`training.data.ingest.dataset_store`) has its shards on S3; a shard that is not on local disk is streamed down (resuming broken connections with ranged
GETs, checked against the manifest's sha256) when a reader first needs it. Afterwards the
cache evicts the least recently used shards of S3-backed datasets until it is under its limit.
Shards of local-only datasets are never evicted: they have no other copy.

Several processes (DataLoader workers, ranks) may share a cache: downloads go to private temp
files renamed into place, and an evicted file stays readable by whoever has it open.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from pydantic import BaseModel

from training.errors import StorageError
from training.storage.files import inside
from training.storage.s3 import S3Settings, S3Store

__all__ = ["REMOTE_MARKER", "RemoteMarker", "local_shard", "evict", "is_remote_dataset", "segment_is_remote"]

log = logging.getLogger(__name__)

REMOTE_MARKER = "remote.json"
_stores: dict[str, S3Store] = {}  # one boto3 client per process and bucket


def is_remote_dataset(dataset_dir: Path) -> bool:
    return (dataset_dir / REMOTE_MARKER).exists()


def segment_is_remote(segment_dir: Path) -> bool:
    return (segment_dir / REMOTE_MARKER).exists()


class RemoteMarker(BaseModel):
    """remote.json in a folder of shards: where they live on S3, and the cache they go to."""

    settings: S3Settings
    rel: str
    cache_bytes: int
    cache_root: str


def _marker(folder: Path) -> RemoteMarker | None:
    try:
        return RemoteMarker.model_validate_json((folder / REMOTE_MARKER).read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:  # ValueError: pydantic's ValidationError too
        raise StorageError(f"{folder / REMOTE_MARKER} is unreadable ({err}); delete it and rerun") from None


def local_shard(folder: Path, name: str, size: int, sha256: str) -> tuple[Path, bool]:
    """(local path of shard `name` of `folder` (a segment's or a format-1 dataset's), whether it
    was just downloaded), downloading it first if the folder's shards live on S3. A download is
    checked against `sha256` as it streams."""
    path = inside(folder, name, "dataset folder")  # the manifest that named it checked it too
    try:
        st = path.stat()
        if st.st_size == size:
            # Recently used, so evicted last: the access time says so. The modification time
            # stays, since the shards' verification record (`first_damage`) is keyed by it: a
            # read must not make the next run hash every shard again.
            os.utime(path, ns=(time.time_ns(), st.st_mtime_ns))
            return path, False
    except FileNotFoundError:
        pass
    marker = _marker(folder)
    if marker is None:
        raise StorageError(f"shard {path} is missing; run the same command again: the pack stage packs it again")
    key = json.dumps(marker.settings.to_json(), sort_keys=True)
    store = _stores.get(key)
    if store is None:
        store = _stores[key] = S3Store(marker.settings)
    store.download_file(f"{marker.rel}/{name}", path, size=size, sha256=sha256)
    evict(Path(marker.cache_root), marker.cache_bytes, keep=path)
    return path, True


def evict(cache_root: Path, limit: int, keep: Path | None = None) -> list[Path]:
    """Delete least recently used shards of S3-backed datasets until they fit in `limit` bytes
    (used: read, by the access time `local_shard` sets, or downloaded)."""
    files: list[tuple[float, int, Path]] = []
    markers = [*cache_root.glob(f"*/{REMOTE_MARKER}"), *cache_root.glob(f"segments/*/{REMOTE_MARKER}")]
    for marker in markers:
        for shard in marker.parent.glob("*.tar"):
            try:
                st = shard.stat()
            except FileNotFoundError:
                continue  # evicted by another process meanwhile
            files.append((max(st.st_atime, st.st_mtime), st.st_size, shard))
    total = sum(size for _, size, _ in files)
    deleted = []
    for _, size, shard in sorted(files):
        if total <= limit:
            break
        if keep is not None and shard == keep:
            continue
        shard.unlink(missing_ok=True)
        total -= size
        deleted.append(shard)
    if deleted:
        log.info("shard cache: evicted %d shards to stay under %.1f GB", len(deleted), limit / (1 << 30))
    return deleted
