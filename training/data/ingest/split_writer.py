"""One split's rows into WebDataset shards: micro-batches of `data.rows_per_member` rows per tar
member, a new shard at `data.shard_size_mb`, written and hashed on a background thread."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from training.config import DataConfig
from training.data.ingest.labels import LABELS
from training.data.batch import present
from training.data.ingest.ragged import OFFSETS, Ragged
from training.data.manifest import ShardInfo, fields_of
from training.data.shards import ShardTarWriter, WrittenShard, encode_npy, member_bytes
from training.data.stored_rows import StoredRows

__all__ = ["SplitWriter"]


class SplitWriter:
    """Buffers one split's rows into micro-batches and rolls shards at the target size."""

    def __init__(self, split: str, out_dir: Path, config: DataConfig) -> None:
        self.split = split
        self.out_dir = out_dir
        self.rows_per_member = config.rows_per_member
        self.target_bytes = int(config.shard_size_mb * 1_000_000)
        self.fields = fields_of(config.vector, config.text, config.image)
        self.count_positives = LABELS[config.task].counts_positives()
        self.buffers: list[StoredRows] = []
        self.buffered = 0
        self.shards: list[ShardInfo] = []
        self.member_index = 0
        self._writer: ShardTarWriter | None = None
        self._closing: list[tuple[str, int, Future[WrittenShard]]] = []
        self._executor: ThreadPoolExecutor | None = None
        self._rows_in_shard = 0
        self.rows = 0
        self.positives = 0

    def add(self, rows: StoredRows) -> None:
        self.buffers.append(rows)
        self.buffered += rows.rows
        while self.buffered >= self.rows_per_member:
            self._emit(self.rows_per_member)

    def _take(self, n: int) -> StoredRows:
        merged = StoredRows.concat(self.buffers)
        rest = merged.slice(n, merged.rows)
        self.buffers = [rest] if rest.rows else []
        self.buffered -= n
        return merged.slice(0, n)

    def _emit(self, n: int) -> None:
        block = self._take(n)
        key = f"b{self.member_index:08d}"
        payloads = []
        members = list(block.members())
        if [name for name, _ in members] != list(self.fields):  # the format's order, which readers rely on
            raise AssertionError(f"rows with members {[name for name, _ in members]}, the split's are {self.fields}")
        for k, values in members:
            if isinstance(values, Ragged):
                payloads += [(f"{key}.{k}.npy", encode_npy(values.data)),
                             (f"{key}.{k}{OFFSETS}.npy", encode_npy(values.offsets))]
            else:
                payloads.append((f"{key}.{k}.npy", encode_npy(values)))
        size = sum(member_bytes(len(p)) for _, p in payloads)
        if self._writer is not None and self._writer.bytes_written + size + 1024 > self.target_bytes:
            self._close_shard()
        if self._writer is None:
            self._open_shard()
        assert self._writer is not None
        for name, payload in payloads:
            self._writer.add(name, payload)
        self.member_index += 1
        self._rows_in_shard += n
        self.rows += n
        if self.count_positives:
            self.positives += int(present(block.label, "label").sum())

    def _open_shard(self) -> None:
        name = f"{self.split}-{len(self.shards) + len(self._closing):06d}.tar"
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"shard-writer-{self.split}")
        self._writer = ShardTarWriter(self.out_dir / name, self._executor)
        self._rows_in_shard = 0
        self._name = name

    def _close_shard(self) -> None:
        assert self._writer is not None
        # Written and fsynced in the background; `finish` collects the sizes and hashes.
        self._closing.append((self._name, self._rows_in_shard, self._writer.close()))
        self._writer = None

    def finish(self) -> None:
        if self.buffered:
            self._emit(self.buffered)
        if self._writer is not None:
            self._close_shard()
        for name, rows, done in self._closing:
            written = done.result()
            self.shards.append(ShardInfo(name, self.split, rows, written.bytes, written.sha256, written.xxh3_128))
        self._closing = []
        self._stop_thread()

    def _stop_thread(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def abort(self) -> None:
        """Stop writing (the pack failed): wait for the background writes, close the files."""
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
        for _, _, done in self._closing:
            done.exception()
        self._closing = []
        self._stop_thread()
