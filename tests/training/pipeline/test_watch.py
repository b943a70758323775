"""The watch stage's listing under the storage root: what arrived since the last look, and a
damaged listing that heals instead of failing every look."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import small_overrides
from training.config import load_config
from training.pipeline.watch_stage import _rel, remember_listing, watch_stage


@pytest.mark.parametrize("damage", ["not-utf8", "folder"])
def test_a_damaged_listing_counts_everything_arrived_and_is_replaced(
        tmp_path: Path, demo_source: Path, damage: str) -> None:
    config = load_config(overrides=small_overrides(tmp_path / "root", demo_source))
    first = watch_stage(config)
    assert first.first_look and first.arrived == [demo_source.name]
    remember_listing(config, first)
    assert watch_stage(config).arrived == []
    listing = tmp_path / "root" / _rel(first.source)
    listing.unlink()
    if damage == "folder":
        (listing / "inside").mkdir(parents=True)
    else:
        listing.write_bytes(b"\xff\xfe{not json")
    look = watch_stage(config)
    assert look.arrived == [demo_source.name]
    remember_listing(config, look)
    assert watch_stage(config).arrived == []
