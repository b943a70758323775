"""Packed datasets under a storage root: `datasets/<fingerprint>/` (shards, then manifest.json).

Datasets publish their shards, then the manifest; a machine that finds the manifest on S3 reads
shards on demand through the size-limited local shard cache (`training.data.shard_cache`), so it
fetches only the manifest here and leaves a marker saying where the shards are.
"""

from __future__ import annotations

import logging
from pathlib import Path

from training.data.packing import DatasetManifest
from training.data.shard_cache import REMOTE_MARKER, RemoteMarker
from training.errors import DataError
from training.storage.files import write_atomic, write_json_atomic
from training.storage.root import SHARD_CACHE, StorageRoot

__all__ = ["DatasetStore"]

log = logging.getLogger(__name__)


class DatasetStore:
    """The packed datasets of one storage root."""

    def __init__(self, root: StorageRoot) -> None:
        self.root = root

    def local_root(self) -> Path:
        path = self.root.path("datasets")
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _mark_remote(self, dataset_dir: Path, rel: str) -> None:
        remote = self.root.remote
        assert remote is not None
        marker = RemoteMarker(settings=remote.settings.to_json(), rel=rel,
                              cache_bytes=int(self.root.config.shard_cache_gb * (1 << 30)),
                              cache_root=str(self.root.local / "datasets"))
        write_json_atomic(dataset_dir / REMOTE_MARKER, marker.model_dump())

    def publish(self, dataset_dir: Path, manifest: DatasetManifest) -> int:
        """Upload the shards that are not there yet, then the manifest; returns bytes uploaded."""
        remote = self.root.remote
        if remote is None:
            return 0
        rel = f"datasets/{manifest.fingerprint}"
        present = remote.list(rel + "/")
        tags = self.root.tags(SHARD_CACHE)
        sent = 0
        for shard in manifest.shards:
            if present.get(f"{rel}/{shard.name}") != shard.bytes:
                remote.upload_file(f"{rel}/{shard.name}", dataset_dir / shard.name, tags)
                sent += shard.bytes
        # Last: a reader that finds the manifest finds every shard it lists.
        remote.upload_file(f"{rel}/manifest.json", dataset_dir / "manifest.json", tags)
        self._mark_remote(dataset_dir, rel)
        return sent

    def fetch(self, fingerprint: str) -> Path | None:
        """The local folder of a dataset published under this root (manifest only: shards come
        on demand through the shard cache), or None when it is absent or incomplete there."""
        remote = self.root.remote
        if remote is None:
            return None
        rel = f"datasets/{fingerprint}"
        data = remote.get_bytes(f"{rel}/manifest.json")
        if data is None:
            return None
        try:
            manifest = DatasetManifest.from_json(data, remote.uri(f"{rel}/manifest.json"))
        except DataError as err:
            log.warning("%s; packing the dataset again", err)
            return None
        present = remote.list(rel + "/")
        missing = [s.name for s in manifest.shards if present.get(f"{rel}/{s.name}") != s.bytes]
        if missing:
            # Expired by the lifecycle rule, or deleted: the dataset is rebuildable, so rebuild it.
            log.warning("%s lacks %d of its shards (e.g. %s): packing again", remote.uri(rel), len(missing), missing[0])
            return None
        dataset_dir = self.root.path(rel)
        dataset_dir.mkdir(parents=True, exist_ok=True)
        self._mark_remote(dataset_dir, rel)
        write_atomic(dataset_dir / "manifest.json", data)  # last, as on S3
        return dataset_dir
