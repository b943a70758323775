"""Feature statistics are derived data with a checksum: damaged ones are fitted again, never used."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from training.config import RetrainConfig
from training.data.prepare.features import checksum_path, verified_feature_stats
from training.pipeline.pack_stage import pack_stage
from training.pipeline.preprocess_stage import preprocess_stage


def _prep(config: RetrainConfig) -> dict:
    packed = pack_stage(config)
    return preprocess_stage(packed.dataset_dir, config.preprocess, config.storage)


@pytest.mark.parametrize("damage", ["truncated", "valid-but-wrong", "checksum-missing"])
def test_damaged_statistics_are_refitted_with_a_warning(small_config: RetrainConfig, damage: str,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    first = _prep(small_config)
    path = Path(first.stats_path)
    good = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif damage == "valid-but-wrong":
        stats = json.loads(good)
        stats["mean"] = [m + 100.0 for m in stats["mean"]]
        path.write_text(json.dumps(stats))
    else:
        checksum_path(path).unlink()
    with caplog.at_level(logging.WARNING):
        again = _prep(small_config)
    assert again.reused is False
    assert path.read_bytes() == good  # fitted again: the same bytes as the first fit
    assert verified_feature_stats(path) is not None
    assert any("failed verification" in r.getMessage() and str(path) in r.getMessage() for r in caplog.records)


def test_intact_statistics_are_reused(small_config: RetrainConfig) -> None:
    assert _prep(small_config).reused is False
    assert _prep(small_config).reused is True


def test_a_numeric_column_with_no_value_in_train_is_an_error_naming_it(demo_source: Path, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.conftest import small_overrides
    from training.config import load_config
    from training.errors import DataError

    table = pq.read_table(demo_source)
    i = table.schema.get_field_index("discount")
    source = tmp_path / "all-null.parquet"
    pq.write_table(table.set_column(i, "discount", pa.nulls(table.num_rows, pa.float64())), source)
    config = load_config(overrides=small_overrides(tmp_path / "root", source))
    with pytest.raises(DataError, match="numeric column 'discount' has no non-null value in the train split"):
        _prep(config)
