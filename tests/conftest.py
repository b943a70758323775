"""Shared fixtures: small real datasets and configs. Nothing here talks to any network."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import tempfile

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# Never touch the developer's ~/.prefect: one throwaway home per test session.
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="retrain-test-prefect-home-")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

from training.config import RetrainConfig, load_config  # noqa: E402
from training.data.demo import ensure_demo_dataset  # noqa: E402

SMALL_ROWS = 8000


@pytest.fixture(scope="session")
def demo_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small demo-generator Parquet file shared by the session (read-only by convention)."""
    path, _ = ensure_demo_dataset(tmp_path_factory.mktemp("demo-src"), rows=SMALL_ROWS, seed=7)
    return path


def small_overrides(root: Path, source: Path) -> list[str]:
    return [
        f"storage.root={root}",
        f"data.source={source}",
        "data.rows_per_member=256",
        "data.shard_size_mb=0.06",
        "train.batch_size=128",
        "train.max_steps=60",
        "train.eval_every=20",
        "train.checkpoint_every=20",
        "train.warmup_steps=5",
        "train.retry_delay_seconds=0",
        "model.hidden=[32, 16]",
        "model.embedding_dim=4",
    ]


@pytest.fixture
def small_config(tmp_path: Path, demo_source: Path) -> RetrainConfig:
    return load_config(overrides=small_overrides(tmp_path / "root", demo_source))
