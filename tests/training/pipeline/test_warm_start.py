from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.conftest import small_overrides
from training.config import RetrainConfig, load_config
from training.protocol.results import TrainResult
from training.data.ingest.validation import category_hash
from training.pipeline.evaluate_stage import evaluate_stage
from training.pipeline.pack_stage import pack_stage
from training.pipeline.preprocess_stage import preprocess_stage
from training.pipeline.train_stage import train_stage
from training.registry.champion import champion_of


def _run(config: RetrainConfig) -> TrainResult:
    packed = pack_stage(config)
    prep = preprocess_stage(packed.dataset_dir, config.preprocess, config.storage)
    trained = train_stage(config, packed, prep, champion_of(config))
    evaluate_stage(config, packed, trained)
    return trained


@pytest.fixture(scope="module")
def champion(tmp_path_factory: pytest.TempPathFactory, demo_source: Path) -> tuple[Path, TrainResult]:
    """A root whose first run asked for a warm start, found no champion, trained fresh and was
    promoted: the champion the tests below start from, each in a copy of the root."""
    root = tmp_path_factory.mktemp("champion") / "root"
    first = _run(load_config(overrides=small_overrides(root, demo_source) + ["eval.target_auc=0.55",
                                                                            "train.init_from=champion"]))
    return root, first


def _config_on_a_copy(champion: tuple[Path, TrainResult], tmp_path: Path, demo_source: Path,
                      *overrides: str) -> RetrainConfig:
    root = tmp_path / "root"
    shutil.copytree(champion[0], root, symlinks=True)
    return load_config(overrides=[*small_overrides(root, demo_source), "eval.target_auc=0.55",
                                  "train.init_from=champion", *overrides])


def test_no_champion_means_a_fresh_start_then_a_warm_start_from_the_compatible_one(
        champion: tuple[Path, TrainResult], tmp_path: Path, demo_source: Path) -> None:
    first = champion[1]
    assert first.warm_start is not None and first.warm_start.to_json() == {
        "requested": True, "used": False, "reason": "no champion yet: fresh start", "champion_sha256": None}

    config = _config_on_a_copy(champion, tmp_path, demo_source, "train.max_steps=20", "train.eval_every=5")
    warm = _run(config)
    assert warm.warm_start.used, warm.warm_start.reason
    assert warm.warm_start.champion_sha256 == first.model.sha256
    assert warm.run_key != first.run_key
    # starting from a trained model, the first validation already clears the target
    assert warm.steps_to_target == 5
    # at a tenth of the fresh start's peak rate (train.warm_lr_scale): no re-warming to the full peak
    peak = config.train.optim.lr * config.train.warm_lr_scale
    assert max(v.lr for v in warm.history) <= peak * (1 + 1e-6) < max(v.lr for v in first.history)


def test_incompatible_champion_falls_back_to_a_fresh_start(champion: tuple[Path, TrainResult], tmp_path: Path,
                                                           demo_source: Path) -> None:
    trained = _run(_config_on_a_copy(champion, tmp_path, demo_source, "model.hidden=[8]"))
    assert not trained.warm_start.used
    assert "model config differs" in trained.warm_start.reason


def test_a_warm_start_grows_the_vocabulary_by_value_and_scores_as_the_champion_did(
        tmp_path: Path, demo_source: Path) -> None:
    """Day 2 brings brands day 1 never had. The warm-started model's vocabulary is the
    champion's, in the champion's order, with the new brands after it; before it trains, it
    scores every row exactly as the champion does: old categories through the champion's own
    embedding rows, new ones through copies of the unknown category's row (as the champion saw
    them)."""
    from tests.conftest import small_overrides
    from training.config import load_config
    from training.data.prepare.features import FeatureStats
    from training.model.network import ModelSchema, forward_fn
    from training.model.spec import build_model
    from training.model.package import load_package, load_warm_start
    from training.registry.champion import check_champion
    from training.pipeline.train_stage import build_train_job
    from training.storage.root import StorageRoot

    table = pq.read_table(demo_source)
    brands = np.array([int(b[1:]) for b in table.column("brand").to_pylist()])  # "b17"
    day1, day2 = table.filter(pa.array(brands < 150)), table
    source = tmp_path / "days"
    source.mkdir()
    pq.write_table(day1, source / "day-1.parquet")
    config = load_config(overrides=small_overrides(tmp_path / "root", source) + ["eval.target_auc=0.5"])
    champion_run = _run(config)
    pq.write_table(day2.slice(0, 3000), source / "day-2.parquet")

    config.train.init_from = "champion"
    packed = pack_stage(config)
    assert packed.segments == 2 and packed.segments_packed == 1
    prep = preprocess_stage(packed.dataset_dir, config.preprocess, config.storage)
    root = StorageRoot.from_config(config)
    champion = check_champion(root, None)
    assert champion is not None and champion.sha256 == champion_run.model.sha256
    job, warm = build_train_job(config, packed, prep, champion)
    assert warm.used, warm.reason
    old_model, old_stats, _ = load_package(champion.package, None)
    grown = FeatureStats.from_json(Path(job.stats_path).read_text())
    brand = config.data.categorical.index("brand")
    assert grown.vocab[brand][: len(old_stats.vocab[brand])] == old_stats.vocab[brand]  # by value, in place
    assert len(grown.vocab[brand]) > len(old_stats.vocab[brand])  # the new brands, after the old ones
    assert grown.mean == old_stats.mean and grown.std == old_stats.std

    new_model = build_model(config.model, ModelSchema.of(grown))
    load_warm_start(new_model, Path(job.init_weights or ""), job.init_sha256)
    rows = day2.slice(0, 2048)
    num = np.stack([rows.column(c).to_numpy().astype(np.float32) for c in config.data.numeric], axis=1)
    cat = np.stack([category_hash(rows.column(c).combine_chunks()) for c in config.data.categorical], axis=1)
    new_codes = ~np.isin(cat[:, brand], old_stats.vocab[brand])
    assert new_codes.any() and (~new_codes).any()
    scores = []
    for model, stats in ((old_model, old_stats), (new_model, grown)):
        x_num, x_cat = stats.transformer()(num, cat)
        model.eval()
        with torch.no_grad():
            scores.append(forward_fn(model)({"num": torch.from_numpy(x_num), "cat": torch.from_numpy(x_cat)}))
    assert torch.equal(scores[0], scores[1])


def test_a_short_warm_start_learns_the_new_rows(tmp_path: Path, demo_source: Path) -> None:
    """Two roots share a champion trained on day 0; each then gets a different day 1: the same
    rows as they are, and with their labels flipped. A short warm start (20 steps) must learn
    what is new: every batch mixes in the new rows, so the two warm starts end as different
    models, and the flipped one ranks those rows worse by their original labels."""
    from tests.conftest import small_overrides
    from training.config import load_config
    from training.model.evaluation import predict_split
    from training.model.package import load_package
    from training.data.load.loader import ShardBatches
    from training.data.manifest import require_manifest
    from training.metrics import roc_auc
    from training.model.objectives import Task

    table = pq.read_table(demo_source)
    day0, day1 = table.slice(0, 7000), table.slice(7000, 1000)
    flipped = day1.set_column(day1.column_names.index("clicked"), "clicked",
                              pa.array(1 - day1.column("clicked").to_numpy(), pa.int8()))
    models = {}
    for name, new in (("same", day1), ("flipped", flipped)):
        source = tmp_path / name / "src"
        source.mkdir(parents=True)
        pq.write_table(day0, source / "day-0.parquet", row_group_size=2000)
        # Large shards (one per split and segment), as in production: plain batches slice them in turn.
        config = load_config(overrides=[*small_overrides(tmp_path / name / "root", source), "data.shard_size_mb=8",
                                        "data.segment_rows=8000"])
        _run(config)
        pq.write_table(new, source / "day-1.parquet", row_group_size=2000)
        config.train.init_from, config.train.max_steps = "champion", 20
        warm = _run(config)
        assert warm.warm_start.used and warm.steps == 20, warm.warm_start.reason
        models[name] = (warm, config)
    assert models["same"][0].model.sha256 != models["flipped"][0].model.sha256

    # The day-1 rows' original labels, scored by each warm-started model.
    scores = {}
    for name, (warm, config) in models.items():
        packed = pack_stage(config)
        manifest = require_manifest(Path(packed.dataset_dir))
        day1_keys = {s.key for s in manifest.segments if s.source == "day-1.parquet"}
        model, stats, _ = load_package(Path(warm.run_dir) / "model", None)
        rows = ShardBatches(Path(packed.dataset_dir), manifest.restricted_to(day1_keys), ("train", "validation", "test"),
                            8192, stats.transformer(), shuffle=False, drop_last=False)
        pred, labels = predict_split(model, Task.of(stats), rows, torch.device("cpu"))
        scores[name] = (pred, labels if name == "same" else 1 - labels)
    (same, y), (flip, _) = scores["same"], scores["flipped"]
    # Flipping also moves the base rate (15 % clicks become 85 %), which lifts every score: the
    # ranking of the rows by their original label is what the flipped labels must undo.
    assert roc_auc(y, flip) < roc_auc(y, same) - 0.01, (roc_auc(y, flip), roc_auc(y, same))


def test_the_effective_step_budget_reaches_the_task_from_the_job(champion: tuple[Path, TrainResult], tmp_path: Path,
                                                                 demo_source: Path) -> None:
    """A warm start trains its own budget (scaled to what is new), not train.max_steps: the
    child's Started event carries the job's, which the task's progress and log lines read."""
    from training.protocol.events import Started

    config = _config_on_a_copy(champion, tmp_path, demo_source, "train.max_steps=200")
    packed = pack_stage(config)
    prep = preprocess_stage(packed.dataset_dir, config.preprocess, config.storage)
    events: list[object] = []
    warm = train_stage(config, packed, prep, champion_of(config), events.append)
    (started,) = [e for e in events if isinstance(e, Started)]
    assert warm.warm_start.used and started.max_steps == warm.steps < config.train.max_steps


def test_a_warm_start_grows_the_output_layer_by_a_new_class(tmp_path: Path, demo_source: Path) -> None:
    """Classes grow in production. The champion knows mainstream, niche and premium; a new file
    adds bargain, which sorts first and so shifts every class index. The warm start keeps the
    champion (each known class keeps its output row, moved to its new index), starts the new
    class's row fresh, ranks the old classes exactly as the champion did before it trains, and
    the run trains and evaluates to the end."""
    import pyarrow.compute as pc

    from tests.conftest import small_overrides
    from training.config import load_config
    from training.data.prepare.features import FeatureStats
    from training.model.network import ModelSchema, forward_fn
    from training.model.spec import build_model
    from training.model.package import load_package, load_warm_start
    from training.registry.champion import check_champion
    from training.pipeline.train_stage import build_train_job
    from training.storage.root import StorageRoot

    table = pq.read_table(demo_source)
    source = tmp_path / "src"
    source.mkdir()
    pq.write_table(table.filter(pc.not_equal(table.column("segment"), "bargain")), source / "day-0.parquet",
                   row_group_size=2000)
    multiclass = ["data.task=multiclass", "data.label=segment", "data.vector=[embedding]", "train.max_steps=60",
                  "train.eval_every=20"]
    config = load_config(overrides=[*small_overrides(tmp_path / "root", source), *multiclass])
    champion_run = _run(config)
    pq.write_table(table.slice(0, 4000), source / "day-1.parquet", row_group_size=2000)

    config.train.init_from = "champion"
    packed = pack_stage(config)
    prep = preprocess_stage(packed.dataset_dir, config.preprocess, config.storage)
    champion = check_champion(StorageRoot.from_config(config), None)
    assert champion is not None and champion.sha256 == champion_run.model.sha256
    job, warm = build_train_job(config, packed, prep, champion)
    assert warm.used and "new classes ['bargain']" in warm.reason, warm.reason
    old_model, old_stats, _ = load_package(champion.package, None)
    grown = FeatureStats.from_json(Path(job.stats_path).read_text())
    assert old_stats.classes == ["mainstream", "niche", "premium"]
    assert grown.classes == ["bargain", "mainstream", "niche", "premium"] and job.init_classes == old_stats.classes

    new_model = build_model(config.model, ModelSchema.of(grown))
    load_warm_start(new_model, Path(job.init_weights or ""), job.init_sha256, job.init_classes, grown.classes)
    rows = table.slice(0, 512)
    num = np.stack([rows.column(c).to_numpy().astype(np.float32) for c in config.data.numeric], axis=1)
    cat = np.stack([category_hash(rows.column(c).combine_chunks()) for c in config.data.categorical], axis=1)
    vec = np.stack(rows.column("embedding").to_numpy(zero_copy_only=False)).astype(np.float32)
    logits = []
    for model, stats in ((old_model, old_stats), (new_model, grown)):
        x_num, x_cat = stats.transformer()(num, cat)
        model.eval()
        with torch.no_grad():
            logits.append(forward_fn(model)({"num": torch.from_numpy(x_num), "cat": torch.from_numpy(x_cat),
                                             "vec": torch.from_numpy(vec)}))
    old, new = logits
    # The old classes' logits are the champion's, in their new places: their ranking is unchanged.
    assert torch.allclose(new[:, 1:], old, atol=1e-6)

    warm_run = _run(config)
    assert warm_run.warm_start.used and warm_run.model is not None
    _, trained_stats, _ = load_package(Path(warm_run.run_dir) / "model", None)
    assert trained_stats.classes == grown.classes
