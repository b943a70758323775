"""Packed datasets and their segments under a storage root, here and on S3.

    datasets/segments/<key>/     a segment: shards, stats.npz, segment.json (last)
    datasets/<fingerprint>/      a dataset: manifest.json listing its segments, and segments.json,
                                 the catalog of every segment its pack knew (their segment.json
                                 in one object: a fresh machine plans the source with one GET)
    datasets/source-index.json   what each source file was packed into (training.data.ingest.source_index)

Publishing uploads what S3 lacks and the marker file last (a segment's segment.json, a
dataset's manifest.json), so a reader that finds the marker finds everything it lists. A
segment uploaded once is never uploaded again: the next dataset that holds it only lists it.
A machine that finds a segment on S3 fetches its manifest and statistics and leaves a marker
saying where the shards are; they come down on demand, through the size-limited shard cache
(`training.data.load.shard_cache`).

Retention (`DatasetStore.retain`) keeps the newest datasets and removes the segments that no
kept dataset lists, here and on S3. On an s3:// root it decides from the manifests on S3 (what
every machine shares), never from this machine's copies alone: a fresh machine holds only the
datasets it packed itself.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import random
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

from pydantic import BaseModel, ConfigDict

from training.data.ingest.segments import (
    MANIFEST,
    STATS_FILE,
    SegmentManifest,
    check_segment,
    first_damage,
    load_segment,
    parse_segment,
    stats_file_damage,
)
from training.data.ingest.source_index import INDEX_FILE, SourceIndex
from training.data.load.shard_cache import REMOTE_MARKER, RemoteMarker
from training.data.manifest import DatasetManifest, is_segment_key
from training.errors import DataError
from training.storage.files import write_atomic, write_json_atomic
from training.storage.root import CACHE, SHARD_CACHE, StorageRoot

__all__ = ["DatasetStore"]

log = logging.getLogger(__name__)

SEGMENTS = "datasets/segments"
CATALOG = "segments.json"
INDEX_LOCK = ".source-index.lock"
INDEX_ATTEMPTS = 20  # compare-and-swap tries of one source index update; eight racing writers need a few each


class SegmentCatalog(BaseModel):
    """`datasets/<fingerprint>/segments.json`: the segment.json of every segment its pack knew."""

    model_config = ConfigDict(extra="forbid")

    segments: list[SegmentManifest]


class DatasetStore:
    """The packed datasets and segments of one storage root."""

    def __init__(self, root: StorageRoot) -> None:
        self.root = root
        self._remote_listing: dict[str, int] | None = None  # rel -> size under datasets/segments/
        self._remote_etags: dict[str, str] = {}  # rel -> ETag under datasets/segments/, from the same listing
        self._listing_lock = threading.Lock()  # planning asks from several threads
        self._remote_datasets: dict[str, float] | None = None  # rel of each dataset manifest -> modified
        self.uploaded_bytes = 0
        self._segments_root: Path | None = None
        self._catalog: dict[str, SegmentManifest] = {}  # segment.json files known from a dataset's catalog

    def local_root(self) -> Path:
        path = self.root.path("datasets")
        path.mkdir(parents=True, exist_ok=True)
        return path

    def segments_root(self) -> Path:
        # Resolved once per store: it is asked once per segment, and a check that the path stays
        # inside the root resolves every link on it.
        if self._segments_root is None:
            path = self.root.path(SEGMENTS)
            path.mkdir(parents=True, exist_ok=True)
            self._segments_root = path
        return self._segments_root

    # -- the source index ---------------------------------------------------------------------

    def index(self) -> SourceIndex:
        """The root's source index, fresh from S3 when the root is there (another machine may
        have packed since this copy was made)."""
        rel = f"datasets/{INDEX_FILE}"
        if self.root.remote is not None:
            self.root.fetch(rel, fresh=True)
        return SourceIndex(self.root.path(rel))

    def update_index(self, change: Callable[[SourceIndex], None]) -> None:
        """Apply `change` to the root's source index and write it, without losing what another
        writer (a Dask worker's flow, a second home) wrote meanwhile: on S3 a
        compare-and-swap on the object's ETag, redone on a fresh copy when another writer came
        first; on a local root under a lock file at the root (beside its writer lock)."""
        rel = f"datasets/{INDEX_FILE}"
        path = self.root.path(rel)
        if self.root.remote is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.root.path(INDEX_LOCK), "a") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
                index = SourceIndex(path)
                change(index)
                index.save()
            return
        for attempt in range(INDEX_ATTEMPTS):
            got = self.root.remote.get_versioned(rel)
            index = SourceIndex(path, got[0] if got is not None else b'{"entries": {}}')
            change(index)
            if not index.changed:
                return
            data = index.to_bytes()
            if self.root.remote.put_bytes(rel, data, self.root.tags(CACHE), if_absent=got is None,
                                          if_match=None if got is None else got[1]):
                index.save()  # this machine's copy
                return
            time.sleep(random.uniform(0.05, 0.25) * (attempt + 1))  # apart, so the next try meets fewer
        log.warning("the source index %s changed under this writer %d times; its new entries are left out (those "
                    "files' footers are read again next time)", self.root.display(rel), INDEX_ATTEMPTS)

    # -- segments -----------------------------------------------------------------------------

    def _mark_remote(self, folder: Path, rel: str) -> None:
        remote = self.root.remote
        assert remote is not None
        marker = RemoteMarker(settings=remote.settings, rel=rel,
                              cache_bytes=int(self.root.config.shard_cache_gb * (1 << 30)),
                              cache_root=str(self.root.local / "datasets"))
        write_json_atomic(folder / REMOTE_MARKER, marker.model_dump())

    def _listing(self) -> dict[str, int]:
        """{"<key>/<file>": size} of every segment file on S3, listed once (with the datasets'
        manifests: one listing of datasets/), by the first of the threads that ask."""
        with self._listing_lock:
            return self._list_once()

    def _list_once(self) -> dict[str, int]:
        if self._remote_listing is None:
            assert self.root.remote is not None
            found = self.root.remote.list_detailed("datasets/")
            strip = len(SEGMENTS) + 1
            self._remote_listing = {rel[strip:]: size for rel, (size, _, _) in found.items()
                                    if rel.startswith(SEGMENTS + "/")}
            self._remote_etags = {rel[strip:]: etag for rel, (_, etag, _) in found.items()
                                  if rel.startswith(SEGMENTS + "/")}
            self._remote_datasets = {rel: modified for rel, (_, _, modified) in found.items()
                                     if not rel.startswith(SEGMENTS + "/") and rel.count("/") == 2
                                     and rel.endswith("/manifest.json")}
        return self._remote_listing

    def available_segment(self, key: str) -> SegmentManifest | None:
        """The segment `key` when it is complete here or on S3 (its shards verified here, or all
        present there), else None: it is packed again. A damaged local copy is removed."""
        if not is_segment_key(key):
            return None
        folder = self.segments_root() / key
        try:
            manifest = load_segment(folder)
        except DataError as err:
            manifest = None
            log.warning("%s; packing the segment again", err)
            self._remove(folder)
        if manifest is not None and not (folder / REMOTE_MARKER).exists():
            damage = first_damage(folder, manifest.shards) or stats_file_damage(folder, manifest)
            if damage is None:
                return manifest
            log.warning("%s; packing it again from the source", damage)
            self._remove(folder)
            manifest = None
        if self.root.remote is None:
            return None
        return self._fetch_segment(key, folder, manifest)

    def _fetch_segment(self, key: str, folder: Path, known: SegmentManifest | None) -> SegmentManifest | None:
        """A segment published on S3: its manifest and statistics here, its shards on demand."""
        listing = self._listing()
        rel = f"{SEGMENTS}/{key}"
        if f"{key}/{MANIFEST}" not in listing:
            return None
        manifest = known or self._catalog_entry(key)
        if manifest is None:
            data = self.root.remote.get_bytes(f"{rel}/{MANIFEST}")  # type: ignore[union-attr]
            if data is None:
                return None
            try:
                manifest = parse_segment(data, key, self.root.display(f"{rel}/{MANIFEST}"))
            except DataError as err:
                log.warning("%s; packing the segment again", err)
                return None
        missing = [s.name for s in manifest.shards if listing.get(f"{key}/{s.name}") != s.bytes]
        if missing or listing.get(f"{key}/{STATS_FILE}") != manifest.stats_bytes:
            # Expired by the lifecycle rule, or deleted: rebuildable from the source.
            log.warning("%s lacks %s: packing the segment again", self.root.display(rel),
                        f"shard {missing[0]}" if missing else STATS_FILE)
            return None
        folder.mkdir(parents=True, exist_ok=True)
        self._mark_remote(folder, rel)
        write_atomic(folder / MANIFEST, manifest.to_bytes())  # last, as on S3
        return manifest

    def _catalog_entry(self, key: str) -> SegmentManifest | None:
        """The catalog's record of segment `key`, only where it is byte for byte the segment's
        own segment.json. The catalog is a fast path, never the truth: S3's listing gives each
        segment.json's ETag (the MD5 of its bytes, for an object put in one part without KMS),
        so agreement costs no request. Where they differ (a planted catalog, or an ETag that is
        not an MD5) the segment's own record is read instead, and the dataset's next write
        replaces the catalog (`write_dataset`)."""
        entry = self._catalog.get(key)
        if entry is None:
            return None
        etag = self._remote_etags.get(f"{key}/{MANIFEST}")
        if etag is not None and hashlib.md5(entry.to_bytes(), usedforsecurity=False).hexdigest() == etag:
            return entry
        log.warning("the catalog's record of segment %s is not its segment.json on %s (damaged, tampered with, or "
                    "an ETag that is not an MD5): reading the segment's own", key[:12], self.root.display(SEGMENTS))
        return None

    def stats_path(self, key: str) -> Path:
        """The local path of a segment's statistics, fetched from S3 when they are only there."""
        rel = f"{SEGMENTS}/{key}/{STATS_FILE}"
        found = self.root.fetch(rel)
        if found is None:
            raise DataError(f"{self.root.display(rel)} is missing; run the same command again: the pack stage packs "
                            "the segment again")
        return found

    def adopt_segment(self, manifest: SegmentManifest) -> None:
        """A segment a worker on another machine packed and published: known here from now on."""
        folder = self.segments_root() / manifest.key
        if (folder / MANIFEST).exists():
            return
        if self.root.remote is None:
            raise DataError(f"segment {manifest.key} of {manifest.source} was packed where this machine cannot see it "
                            f"({folder} does not exist): with workers on other machines, set storage.root to an s3:// "
                            "prefix or a folder every machine shares")
        folder.mkdir(parents=True, exist_ok=True)
        self._mark_remote(folder, f"{SEGMENTS}/{manifest.key}")
        write_atomic(folder / MANIFEST, manifest.to_bytes())

    def publish_segment(self, manifest: SegmentManifest) -> int:
        """Upload a segment packed here, segment.json last; bytes uploaded. When S3 holds this
        very segment already (its manifest byte for byte: another packer won), nothing is sent;
        otherwise every file goes up except shards a packer of the same key left there before
        it could write the manifest (same name and size: the key addresses their content, and
        a reader checks each download against its sha256)."""
        remote = self.root.remote
        if remote is None:
            return 0
        rel = f"{SEGMENTS}/{manifest.key}"
        folder = self.segments_root() / manifest.key
        ours = (folder / MANIFEST).read_bytes()
        present = remote.list(rel + "/")
        if f"{rel}/{MANIFEST}" in present and remote.get_bytes(f"{rel}/{MANIFEST}") == ours:
            return 0
        tags = self.root.tags(SHARD_CACHE)
        sent = 0
        for name, size in [*((s.name, s.bytes) for s in manifest.shards), (STATS_FILE, manifest.stats_bytes)]:
            if name == STATS_FILE or present.get(f"{rel}/{name}") != size:
                remote.upload_file(f"{rel}/{name}", folder / name, tags)
                sent += size
        remote.upload_file(f"{rel}/{MANIFEST}", folder / MANIFEST, tags)
        return sent + len(ours)

    # -- datasets -----------------------------------------------------------------------------

    def write_dataset(self, manifest: DatasetManifest, segments: list[SegmentManifest] | None = None) -> Path:
        """`datasets/<fingerprint>/manifest.json` and its catalog of `segments`, here and then on
        S3 (`_put_dataset_file`: created where absent, replaced where S3 holds other bytes), the
        manifest last, after the catalog it vouches for."""
        folder = self.local_root() / manifest.fingerprint
        folder.mkdir(parents=True, exist_ok=True)
        data = manifest.to_json().encode()
        catalog = SegmentCatalog(segments=segments).model_dump_json().encode() if segments else None
        for name, content in ((CATALOG, catalog), ("manifest.json", data)):
            if content is not None and (not (folder / name).exists() or (folder / name).read_bytes() != content):
                write_atomic(folder / name, content)
        remote = self.root.remote
        if remote is not None:
            rel = f"datasets/{manifest.fingerprint}"
            for name, content in ((CATALOG, catalog), ("manifest.json", data)):
                if content is not None and self._put_dataset_file(f"{rel}/{name}", content):
                    self.uploaded_bytes += len(content)
        return folder

    def _put_dataset_file(self, rel: str, content: bytes) -> bool:
        """One file of a dataset on S3, as this packer computed it: created where absent
        (`If-None-Match`: of racing writers the first stands), and where S3 holds other bytes,
        replaced, but only over the version read (`If-Match`). The fingerprint addresses the
        manifest's content, so other bytes under it were not written by a packer: left in place,
        a tampered manifest would fail every fresh machine for good. A catalog lists the segments
        its packer knew, which another packer may know otherwise: one whose every record is its
        segment's own segment.json stands. Whether it sent anything."""
        remote = self.root.remote
        assert remote is not None
        got = remote.get_versioned(rel)
        if got is None:
            return remote.put_bytes(rel, content, self.root.tags(SHARD_CACHE), if_absent=True)
        if got[0] == content or (rel.endswith(CATALOG) and self._catalog_agrees(got[0])):
            return False
        log.warning("%s is not what packing this dataset writes (damaged, or written by another hand): replacing it",
                    remote.uri(rel))
        return remote.put_bytes(rel, content, self.root.tags(SHARD_CACHE), if_match=got[1])

    def _catalog_agrees(self, data: bytes) -> bool:
        """Whether a catalog's every entry is byte for byte its segment's segment.json on S3."""
        try:
            found = SegmentCatalog.model_validate_json(data).segments
        except ValueError:
            return False
        self._listing()
        return all(self._remote_etags.get(f"{segment.key}/{MANIFEST}")
                   == hashlib.md5(segment.to_bytes(), usedforsecurity=False).hexdigest() for segment in found)

    def prime_catalog(self, fingerprint: str | None = None) -> int:
        """Know the segments of dataset `fingerprint`'s catalog (or of the newest dataset on the
        root) from one GET, instead of one GET of segment.json per segment; how many. Each
        entry is checked as a segment.json is, and, when used, against the listing and the
        source index as one is: the catalog is input from whoever can write the root."""
        remote = self.root.remote
        if remote is None:
            return 0
        if fingerprint is None:
            self._listing()
            newest = max((self._remote_datasets or {}).items(), key=lambda item: item[1], default=None)
            if newest is None:
                return 0
            fingerprint = newest[0].split("/")[1]
        rel = f"datasets/{fingerprint}/{CATALOG}"
        data = remote.get_bytes(rel)
        if data is None:
            return 0
        try:
            found = SegmentCatalog.model_validate_json(data).segments
            for segment in found:
                check_segment(segment, segment.key, f"{remote.uri(rel)} (segment {segment.key})")
        except (ValueError, DataError) as err:
            log.warning("%s is unreadable or damaged (%s): its segments are read one by one", remote.uri(rel),
                        str(err).splitlines()[0])
            return 0
        self._catalog.update({segment.key: segment for segment in found})
        return len(found)

    def fetch_dataset(self, fingerprint: str) -> Path | None:
        """The local folder of a dataset published under this root (its manifest; format-1
        shards on demand), or None when it is absent there."""
        remote = self.root.remote
        folder = self.local_root() / fingerprint
        if remote is None:
            return folder if (folder / "manifest.json").exists() else None
        rel = f"datasets/{fingerprint}"
        data = remote.get_bytes(f"{rel}/manifest.json")
        if data is None:
            return None
        try:
            manifest = DatasetManifest.from_json(data, remote.uri(f"{rel}/manifest.json"))
        except DataError as err:
            log.warning("%s; packing the dataset again", err)
            return None
        if manifest.format_version < 2:
            present = remote.list(rel + "/")
            if any(present.get(f"{rel}/{s.name}") != s.bytes for s in manifest.shards):
                return None  # expired by the lifecycle rule: packed again
            folder.mkdir(parents=True, exist_ok=True)
            self._mark_remote(folder, rel)
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(folder / "manifest.json", data)
        return folder

    # -- retention ----------------------------------------------------------------------------

    def retain(self, current: str, keep: int) -> list[str]:
        """Keep `current` and the `keep` newest other datasets; remove the others and every
        segment no kept dataset lists, here and on S3. Returns the removed segment keys."""
        datasets = self._datasets()
        newest = sorted((m for fp, m in datasets.items() if fp != current), key=lambda m: -m[0])[:keep]
        kept = {current, *(m[1].fingerprint for m in newest)}
        listed = {s.key for fp in kept if fp in datasets for s in datasets[fp][1].segments}
        for fp in set(datasets) - kept:
            self._remove(self.local_root() / fp)
            self._delete_remote(f"datasets/{fp}/")
        removed = []
        for folder in sorted(self.segments_root().iterdir()):
            if folder.name.startswith(".partial-") or (is_segment_key(folder.name) and folder.name not in listed):
                self._remove(folder)
                if not folder.name.startswith("."):
                    removed.append(folder.name)
        if self.root.remote is not None:
            remote_keys = {rel.split("/", 1)[0] for rel in self._listing() if "/" in rel}
            for key in sorted(remote_keys - listed):
                if is_segment_key(key):
                    self._delete_remote(f"{SEGMENTS}/{key}/")
                    removed.append(key)
        return sorted(set(removed))

    def _datasets(self) -> dict[str, tuple[float, DatasetManifest]]:
        """Every dataset manifest here and, on an s3:// root, on S3 (whose copy and time win),
        with its modification time."""
        found: dict[str, tuple[float, DatasetManifest]] = {}
        for path in self.local_root().glob("*/manifest.json"):
            try:
                manifest = DatasetManifest.from_json(path.read_bytes(), str(path))
            except (DataError, OSError):
                continue
            found[path.parent.name] = (path.stat().st_mtime, manifest)
        if self.root.remote is not None:
            self._listing()
            assert self._remote_datasets is not None
            for rel, modified in self._remote_datasets.items():
                remote = self._remote_manifest(rel)
                if remote is not None:
                    found[remote.fingerprint] = (modified, remote)
        return found

    def _remote_manifest(self, rel: str) -> DatasetManifest | None:
        """The dataset manifest at `rel` on S3, when it is one and names the folder it is in."""
        assert self.root.remote is not None
        data = self.root.remote.get_bytes(rel)
        if data is None:
            return None
        try:
            manifest = DatasetManifest.from_json(data, self.root.remote.uri(rel))
        except DataError as err:
            log.warning("%s; retention does not count it", err)
            return None
        return manifest if rel == f"datasets/{manifest.fingerprint}/manifest.json" else None

    def _remove(self, folder: Path) -> None:
        trash = folder.with_name(f".{folder.name}.removed-{uuid.uuid4().hex[:12]}")
        try:
            folder.rename(trash)  # out of the way at once: readers never see half of it
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)
        folder.with_name(f".{folder.name}.verified.json").unlink(missing_ok=True)

    def _delete_remote(self, rel_prefix: str) -> None:
        if self.root.remote is not None:
            rels = list(self.root.remote.list(rel_prefix))
            self.root.remote.delete(rels)
