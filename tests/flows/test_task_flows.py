"""A flow per task under the Prefect test server: multiclass on a dataset scikit-learn ships
(the 8x8 digits, as a vector column), then regression on the demo data in the same root, whose
champion (multiclass) it must not replace; and text and image columns end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from flows.retrain import retrain
from training.config import RetrainConfig, load_config


def _report(path: str) -> dict:
    return json.loads(Path(path).read_text())


def _digits(tmp_path: Path) -> Path:
    from sklearn.datasets import load_digits

    digits = load_digits()
    path = tmp_path / "digits.parquet"
    pixels = pa.FixedSizeListArray.from_arrays(pa.array((digits.data / 16.0).astype(np.float32).ravel()), 64)
    pq.write_table(pa.table({"pixels": pixels, "digit": pa.array(digits.target.astype(np.int64))}), path)
    return path


def _config(root: Path, source: Path, extra: list[str]) -> RetrainConfig:
    return load_config(overrides=[
        f"storage.root={root}", f"data.source={source}", "data.rows_per_member=256", "data.shard_size_mb=0.06",
        "train.batch_size=128", "train.max_steps=300", "train.eval_every=50", "train.checkpoint.every=50",
        "train.schedule.warmup_steps=10", "train.loader.num_workers=0", "train.retry.delay_seconds=0", "model.hidden=[64]",
        *extra])


def test_multiclass_then_regression_flows(tmp_path: Path, demo_source: Path) -> None:
    from sklearn.linear_model import LogisticRegression

    root = tmp_path / "root"
    digits = _config(root, _digits(tmp_path), ["data.task=multiclass", "data.label=digit", "data.numeric=[]", "train.max_steps=800", "train.patience=0",
                                                "data.categorical=[]", "data.vector=[pixels]"])
    report = _report(retrain(digits))
    assert report["task"] == "multiclass" and report["metric"] == "accuracy"
    assert set(report["metrics"]) == {"accuracy", "macro_f1", "logloss"}
    assert report["promotion"]["promoted"] and report["status"] in ("completed", "early_stopped")
    assert "test accuracy" in Path(report["files"]["report_md"]).read_text()

    # The reference: logistic regression on the same train and test rows, read back from the shards.
    from training.data.prepare.features import FeatureStats
    from training.data.load.loader import ShardBatches, iter_split
    from training.data.manifest import require_manifest

    dataset_dir = Path(report["stages"]["pack"]["dir"])
    manifest = require_manifest(dataset_dir)
    assert manifest.classes == list(range(10))
    stats = FeatureStats.from_json(Path(report["stages"]["preprocess"]["stats"]).read_text())

    def split(name: str) -> tuple[np.ndarray, np.ndarray]:
        batches = ShardBatches(dataset_dir, manifest, name, 4096, stats.transformer(), shuffle=False, drop_last=False)
        (batch,) = list(iter_split(batches))
        return batch["vec"].numpy(), batch["label"].numpy()

    (x_train, y_train), (x_test, y_test) = split("train"), split("test")
    reference = float((LogisticRegression(max_iter=5000).fit(x_train, y_train).predict(x_test) == y_test).mean())
    print(f"\ndigits ({len(y_test)} test rows): accuracy {report['metrics']['accuracy']:.4f}, "
          f"macro F1 {report['metrics']['macro_f1']:.4f}; logistic regression accuracy {reference:.4f}")
    assert report["metrics"]["accuracy"] >= reference - 0.03

    regression = _config(root, demo_source, ["data.task=regression", "data.label=basket_value"])
    second = _report(retrain(regression))
    assert second["task"] == "regression" and set(second["metrics"]) == {"rmse", "mae", "r2"}
    assert second["metrics"]["r2"] > 0.5
    assert second["stages"]["preprocess"]["target_transform"] == "log1p"  # auto's choice: a skewed amount
    assert report["stages"]["preprocess"]["target_transform"] is None  # not a regression
    assert not second["promotion"]["promoted"]
    assert "promotion skipped" in second["promotion"]["reason"]
    assert "it is a multiclass model and this run is regression" in second["promotion"]["reason"]
    champion = json.loads((root / "models" / "champion").read_text())
    assert champion["sha256"] == report["model"]["sha256"]  # the digits model stays the champion


def test_a_text_and_image_flow_trains_stores_tokens_and_packages_the_tokenizer(tmp_path: Path) -> None:
    from tests.shipped_data import write_digit_images
    from training.model.package import package_stats

    root = tmp_path / "root"
    config = _config(root, write_digit_images(tmp_path / "digits.parquet"), [
        "data.task=multiclass", "data.label=digit", "data.numeric=[]", "data.categorical=[]", "data.text=[note]",
        "data.image=[image]", "preprocess.vocab_size=100", "preprocess.max_tokens=8", "preprocess.image_size=8",
        "model.text_dim=16", "model.text_layers=1", "model.text_heads=2", "model.image_channels=[16, 32]",
        "data.shard_size_mb=0.2"])
    report = _report(retrain(config))
    assert report["task"] == "multiclass" and report["promotion"]["promoted"]
    assert report["metrics"]["accuracy"] > 0.8, report["metrics"]
    stats_dir = Path(report["stages"]["preprocess"]["stats"]).parent
    stored = json.loads((stats_dir / "arrays" / "arrays.json").read_text())
    assert len(stored) == len(json.loads((Path(report["stages"]["pack"]["dir"]) / "manifest.json").read_text())["shards"])
    packaged = package_stats(root / "runs" / report["run_key"] / "model")
    assert packaged.text == ["note"] and packaged.image == ["image"] and '"BPE"' in packaged.tokenizer
