"""What a dataset is made from: the source's Parquet files and the fingerprint of their bytes
and of the data config, which names the packed dataset. Kept free of pyarrow so `retrain run`
can tell an unchanged rerun before it loads the pipeline (see `training.pipeline.unchanged`)."""

from __future__ import annotations

from pathlib import Path

from training.config import DataConfig, fingerprint, fingerprinted
from training.errors import DataError
from training.storage.files import sha256_file

__all__ = ["PACK_FORMAT_VERSION", "dataset_fingerprint", "source_files"]

PACK_FORMAT_VERSION = 1


def source_files(source: Path, setting: str = "data.source") -> list[Path]:
    """The Parquet files of `source` (a file, or a folder searched recursively), in name order;
    `setting` is what the user sets to name another one (for the error)."""
    if source.is_dir():
        files = sorted(p for p in source.rglob("*.parquet") if p.is_file())
        if not files:
            raise DataError(f"source directory {source} holds no *.parquet files; set {setting} to a Parquet file or "
                            "a folder of them")
        return files
    if not source.exists():
        raise DataError(f"source {source} does not exist; set {setting} to a Parquet file or directory")
    return [source]


def dataset_fingerprint(files: list[Path], config: DataConfig) -> tuple[str, list[dict[str, object]]]:
    sources = [{"name": p.name, "bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in files]
    fp = fingerprint(
        "dataset", PACK_FORMAT_VERSION, [(s["bytes"], s["sha256"]) for s in sources],
        fingerprinted(config),  # the fields marked COMPUTED: not the path, not the parallelism
    )
    return fp, sources
