"""The watch stage: which files arrived in the source since it was last looked at.

The `watch` flow lists `data.source` (a folder or an s3:// prefix) on a schedule, without
reading any file, and compares the listing with the one it recorded last time under the
storage root (`watch/<source>.json`). A file that is new, or whose identity changed (size,
times, inode; an S3 object's ETag), has arrived; the flow emits `retrain.data.arrived` naming
them, which the retrain deployment's trigger starts a run on. The listing is recorded after
the event is sent: a watch killed in between sends it again, and the run it starts finds the
earlier files packed already.
"""

from __future__ import annotations

import logging
import shutil

from pydantic import BaseModel, ConfigDict, ValidationError

from training.config import RetrainConfig, fingerprint
from training.data.ingest.sources import SourceFile, open_source
from training.errors import StorageError
from training.pipeline.pack_stage import resolve_source
from training.storage.files import read_json, write_json_atomic
from training.storage.root import CACHE, StorageRoot

log = logging.getLogger(__name__)

__all__ = ["Arrival", "remember_listing", "watch_stage"]


class Arrival(BaseModel):
    """What a look at the source found."""

    model_config = ConfigDict(frozen=True)

    source: str
    resource_id: str  # the event's resource: retrain.source.<16 hex of the source>
    files: list[SourceFile]  # the whole listing
    arrived: list[str]  # names of the files new or changed since the last look
    first_look: bool  # nothing was recorded before

    @property
    def arrived_bytes(self) -> int:
        names = set(self.arrived)
        return sum(f.size for f in self.files if f.name in names)


class _Listing(BaseModel):
    files: list[SourceFile]


def _rel(source: str) -> str:
    return f"watch/{fingerprint('watch', source)}.json"


def watch_stage(config: RetrainConfig) -> Arrival:
    """List the source and compare with the last recorded listing."""
    root = StorageRoot.from_config(config)
    spec, _ = resolve_source(config, root)
    source = open_source(spec, config.storage)
    files = source.files()
    rel = _rel(source.uri)
    found = root.fetch(rel, fresh=True)
    before: set[SourceFile] = set()
    first = True
    if found is not None:
        try:
            before = set(_Listing.model_validate(read_json(found)).files)
            first = False
        except (ValidationError, ValueError, TypeError, StorageError) as err:
            # Unreadable (not UTF-8, not JSON, a folder in its place): everything counts as
            # arrived, which costs a run that finds it packed, and the next listing replaces it.
            log.warning("%s is unreadable (%s): every file counts as arrived", root.display(rel),
                        str(err).splitlines()[0])
            first = True
    arrived = [f.name for f in files if f not in before]
    return Arrival(source=source.uri, resource_id=f"retrain.source.{fingerprint('watch', source.uri)}", files=files,
                   arrived=arrived, first_look=first)


def remember_listing(config: RetrainConfig, arrival: Arrival) -> None:
    """Record the listing the next look compares with (after the event went out)."""
    root = StorageRoot.from_config(config)
    rel = _rel(arrival.source)
    path = root.path(rel)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)  # a folder where this listing belongs: it would fail every look
    write_json_atomic(path, _Listing(files=arrival.files).model_dump(mode="json"))
    root.publish(rel, CACHE)
