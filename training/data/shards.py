"""The shard format: plain ustar archives that WebDataset reads, written reproducibly.

Each tar member holds a micro-batch of rows as one `.npy` array per field, grouped under a
WebDataset key: `b00000042.num.npy`, `b00000042.cat.npy`, `b00000042.label.npy`, and
`b00000042.vec.npy` when the dataset has vector columns. So
`webdataset.WebDataset(url).decode()` yields one micro-batch per sample.

Why not `webdataset.ShardWriter`/`WebDataset` here (webdataset 1.0.2, measured on a 2-core box):
- ShardWriter stamps wall-clock mtimes and PAX headers: not byte-reproducible, 3-5x bytes on disk
  for small records, and its `maxsize` ignores headers; we need exact, reproducible shard sizes.
- The per-sample read pipeline decodes 2-4k samples/s; an mmap ustar parser with
  `np.frombuffer` reads the same bytes zero-copy at 50-75k rows/s and more with micro-batches.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import mmap
import os
import tarfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from training.data.stored_rows import StoredRows, UnknownMembers
from training.errors import DamagedShard, DataError, StorageError

__all__ = ["Checksum", "ShardTarWriter", "ShardReader", "WrittenShard", "encode_npy", "FIELDS", "member_bytes"]

FIELDS = ("num", "cat", "label")
# Parsed .npy headers, by their bytes.
_HEADERS: dict[bytes, tuple[tuple[int, ...], bool, np.dtype, int]] = {}
_BLOCK = 512
_NUMERIC_KINDS = "biuf"  # bool, signed, unsigned, float: all a shard member may hold
_CORRUPT = ("shard {path}: {algorithm} does not match the dataset manifest (corrupt); run the same command again: "
            "the pack stage finds it and packs the dataset again")


@dataclass(frozen=True)
class Checksum:
    """What a shard's bytes must hash to. sha256 names a shard's content (and checks downloads);
    a shard is checked with xxh3_128 where the manifest has it, which finds corruption as surely
    (a corrupt shard is a disk or copy fault, not an attacker): the demo's 7 train shards (97 MB)
    hashed in 15 ms against 66 ms for sha256, through fresh mappings (medians of 7)."""

    algorithm: str  # "xxh3_128" or "sha256"
    hexdigest: str

    def matches(self, data: object) -> bool:
        hasher = xxhash.xxh3_128 if self.algorithm == "xxh3_128" else hashlib.sha256
        return hasher(data).hexdigest() == self.hexdigest  # type: ignore[arg-type]

    def matches_file(self, path: Path) -> bool:
        try:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                return self.matches(mm)
        except ValueError:  # an empty file cannot be mapped: a shard is never empty
            return False


@dataclass(frozen=True)
class WrittenShard:
    bytes: int
    sha256: str
    xxh3_128: str


def encode_npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


def member_bytes(payload_size: int) -> int:
    """Bytes a member occupies in a ustar archive: one header block plus padded payload."""
    return _BLOCK + -(-payload_size // _BLOCK) * _BLOCK


class ShardTarWriter:
    """Writes one ustar shard with fixed metadata (mtime 0, uid 0, mode 0644): same input, same
    bytes, as `tarfile` would write them (its `TarInfo` encodes the headers).

    Hashing, writing and the final fsync run on a background thread (hashlib and file writes
    release the GIL), so they overlap the packer's Parquet decoding on another core: 80 ms of
    a 270 ms pack of 30 MB in a profile. At most `max_pending` members wait for it, which
    bounds the memory held."""

    def __init__(self, path: Path, executor: ThreadPoolExecutor | None = None, max_pending: int = 16) -> None:
        self.path = path
        try:
            self._file = open(path, "wb")
        except OSError as err:
            raise StorageError(f"cannot write shard {path}: {err.strerror or err}") from None
        self._hash = hashlib.sha256()
        self._fast_hash = xxhash.xxh3_128()
        self._room = threading.BoundedSemaphore(max_pending)
        # One thread, so the writes stay in order; shared by a split's consecutive shards (a
        # thread per shard grew the packer's RSS with the shard count: allocator arenas).
        self._own_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer")
        self._error: OSError | None = None
        self.bytes_written = 0  # archive bytes so far, headers counted

    def _write(self, data: bytes) -> None:
        try:
            if self._error is None:
                self._hash.update(data)
                self._fast_hash.update(data)
                self._file.write(data)
        except OSError as err:
            self._error = err
        finally:
            self._room.release()

    def _check(self) -> None:
        if self._error is not None:
            raise StorageError(f"cannot write shard {self.path}: {self._error.strerror or self._error}")

    def _submit(self, data: bytes) -> None:
        self._check()
        self._room.acquire()
        self._executor.submit(self._write, data)
        self.bytes_written += len(data)

    def add(self, name: str, payload: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(payload)
        info.mtime = 0
        info.mode = 0o644
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        header = info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")
        self._submit(b"".join((header, payload, b"\0" * (-len(payload) % _BLOCK))))

    def close(self) -> Future[WrittenShard]:
        """End the archive as `tarfile` does (two zero blocks, padded to a whole record); the
        future gives its size and hashes once the file is written, fsynced and closed."""
        end = 2 * _BLOCK
        end += -(self.bytes_written + end) % tarfile.RECORDSIZE
        self._submit(b"\0" * end)

        def finish() -> WrittenShard:
            try:
                self._check()
                self._file.flush()
                os.fsync(self._file.fileno())
                written = WrittenShard(self._file.tell(), self._hash.hexdigest(), self._fast_hash.hexdigest())
                self._file.close()
                return written
            except OSError as err:
                raise StorageError(f"cannot write shard {self.path}: {err.strerror or err}") from None
            finally:
                if not self._file.closed:
                    # After a failed write: closing flushes what is still buffered, which fails
                    # the same way, and must not replace the error that names the shard.
                    with contextlib.suppress(OSError):
                        self._file.close()

        done = self._executor.submit(finish)
        if self._own_executor:
            self._executor.shutdown(wait=False)
        return done

    def abort(self) -> None:
        if self._own_executor:
            self._executor.shutdown(wait=True, cancel_futures=True)
        else:
            self._error = self._error or OSError("aborted")  # queued writes skip
            self._executor.submit(lambda: None).result()
        try:
            self._file.close()
        except OSError:
            pass  # its buffered bytes could not go either (a full disk): the file is deleted next


@dataclass(frozen=True)
class _Member:
    offset: int
    size: int


class ShardReader:
    """Zero-copy reader of one shard: an mmap plus an index of member offsets.

    `block(i)` returns the i-th micro-batch as numpy views into the mapped file.
    """

    def __init__(self, path: Path, checksum: Checksum | None = None) -> None:
        """With `checksum`, the file is checked against it before anything in it is parsed."""
        self.path = path
        try:
            with open(path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as err:  # ValueError: an empty file cannot be mapped
            if checksum is not None and isinstance(err, ValueError):
                raise DamagedShard(_CORRUPT.format(path=path, algorithm=checksum.algorithm)) from None
            raise DataError(f"shard {path}: cannot open ({err})") from None
        # Hashing the mapping rather than read()ing the file spares a copy, and the pages it
        # faults in are those the blocks are then read from (the demo's 7 train shards, 97 MB,
        # with sha256: 63 ms against 76 ms through read(), measured).
        if checksum is not None and not checksum.matches(self._mm):
            self.close()
            # DamagedShard: the stage that meets it makes the next pack hash every shard again.
            raise DamagedShard(_CORRUPT.format(path=path, algorithm=checksum.algorithm))
        self._members = self._index()
        keys = sorted({name.split(".", 1)[0] for name in self._members})
        self.keys = keys
        # The arrays a member key holds, in archive order: num, cat, label, and vec when the
        # dataset has vector columns.
        self.fields = tuple(dict.fromkeys(name.split(".")[1] for name in self._members if name.count(".") == 2))

    def _index(self) -> dict[str, _Member]:
        members: dict[str, _Member] = {}
        mm = self._mm
        pos = 0
        while pos + _BLOCK <= len(mm):
            header = mm[pos : pos + _BLOCK]
            if header == b"\0" * _BLOCK:
                break
            name = header[0:100].split(b"\0", 1)[0].decode()
            prefix = header[345:500].split(b"\0", 1)[0].decode()
            if prefix:
                name = f"{prefix}/{name}"
            try:
                size = int(header[124:136].split(b"\0", 1)[0].strip() or b"0", 8)
            except ValueError:
                raise DataError(f"shard {self.path}: corrupt tar header at byte {pos}") from None
            members[name] = _Member(pos + _BLOCK, size)
            pos += member_bytes(size)
        return members

    def _array(self, name: str) -> np.ndarray:
        m = self._members.get(name)
        if m is None:
            raise DataError(f"shard {self.path}: member {name} is missing")
        raw = self._mm[m.offset : m.offset + min(m.size, 256)]
        if raw[:6] != b"\x93NUMPY" or len(raw) < 12:
            raise DataError(f"shard {self.path}: member {name} is not a .npy array")
        end = 10 + int.from_bytes(raw[8:10], "little") if raw[6] == 1 else 12 + int.from_bytes(raw[8:12], "little")
        raw = raw[:end]  # the header alone: the key under which its parse is kept
        parsed = _HEADERS.get(raw)
        if parsed is None:
            # numpy parses the header with ast.literal_eval, 30 us a member; members of one
            # dataset share a few distinct headers, so each is parsed once per process.
            parsed = self._parse_header(name, raw)
            if len(_HEADERS) > 1024:
                _HEADERS.clear()
            _HEADERS[raw] = parsed
        shape, fortran, dtype, header_size = parsed
        data_offset = m.offset + header_size
        count = int(np.prod(shape)) if shape else 1
        if header_size + count * dtype.itemsize > m.size:
            raise DamagedShard(self.path, f"member {name} holds fewer bytes than its header declares")
        arr = np.frombuffer(self._mm, dtype=dtype, count=count, offset=data_offset)
        return arr.reshape(shape, order="F" if fortran else "C")

    def _parse_header(self, name: str, raw: bytes) -> tuple[tuple[int, ...], bool, np.dtype, int]:
        """(shape, fortran order, dtype, header bytes) of a member's .npy header. Packing writes
        plain numbers only: an object dtype (which numpy would unpickle) or a header that does
        not parse is a damaged shard."""
        header = io.BytesIO(raw)
        try:
            version = np.lib.format.read_magic(header)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(header)
            else:
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(header)
        except (ValueError, SyntaxError, TypeError) as err:
            raise DamagedShard(self.path, f"member {name} has an unreadable .npy header ({err})") from None
        if dtype.hasobject or dtype.kind not in _NUMERIC_KINDS or any(d < 0 for d in shape):
            raise DamagedShard(self.path, f"member {name} holds {dtype} values, not numbers")
        return shape, fortran, dtype, header.tell()

    def check_members(self) -> None:
        """Parse every member's header (a DamagedShard if one is not a plain numeric array)."""
        for name in self._members:
            if name.endswith(".npy"):
                self._array(name)

    def block(self, key: str) -> StoredRows:
        """The rows of member key `key` (views into the mapped file: drop them before `close`)."""
        try:
            return StoredRows.from_members({field: self._array(f"{key}.{field}.npy") for field in self.fields})
        except UnknownMembers as err:
            raise DamagedShard(self.path, f"block {key}: {err}") from None

    def close(self) -> None:
        try:
            self._mm.close()
        except BufferError:
            pass  # arrays still view the mapping; it is unmapped when the last one is freed
