from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.training.helpers import make_job
from training.config import EvalConfig, RetrainConfig
from training.model.model_ref import ChampionPointer, read_pointer
from training.registry.champion import decide_promotion, promote
from training.trainer.run import train
from training.pipeline.evaluate_stage import evaluate_stage
from training.pipeline.pack_stage import pack_stage


def test_decisions() -> None:
    cfg = EvalConfig(min_delta=0.01)
    assert decide_promotion("a", {"auc": 0.8}, None, None, cfg) == (True, "no champion yet; test AUC 0.8000")
    assert not decide_promotion("a", {"auc": 0.805}, "b", {"auc": 0.8}, cfg)[0]  # gain below min_delta
    assert decide_promotion("a", {"auc": 0.82}, "b", {"auc": 0.8}, cfg)[0]
    assert not decide_promotion("a", {"auc": 0.9}, "a", {"auc": 0.9}, cfg)[0]
    ok, why = decide_promotion("a", {"auc": 0.7}, None, None, EvalConfig(target_auc=0.75))
    assert not ok and "below eval.target_auc" in why
    # A champion whose pointer cannot be read has no name to show: none is made up.
    ok, why = decide_promotion("a", {"auc": 0.8}, None, None, cfg, champion_problem="pointer damaged")
    assert ok and why.startswith("the champion is unusable (pointer damaged); judged alone")


def _trained(config: RetrainConfig, name: str) -> tuple[dict, dict]:
    packed = pack_stage(config)
    job = make_job(config, name)
    result = train(job)
    assert result is not None
    return packed, result.model_copy(update={"run_dir": job.run_dir})


def test_worse_challenger_keeps_the_champion_a_better_one_is_promoted(small_config: RetrainConfig) -> None:
    small_config.eval.promote_on = "point"  # the raw decision; the interval's is tested below
    packed, good = _trained(small_config, "good")
    first = evaluate_stage(small_config, packed, good)
    assert first.promotion.promoted
    champion = read_pointer(Path(small_config.storage.root) / "models" / "champion")
    assert champion is not None and champion.sha256 == good.model.sha256

    small_config.train.max_steps = 3  # barely trained: worse
    small_config.train.eval_every = 3
    packed, bad = _trained(small_config, "bad")
    second = evaluate_stage(small_config, packed, bad)
    assert not second.promotion.promoted
    assert second.promotion.champion_metrics["auc"] > second.metrics["auc"]
    assert read_pointer(Path(small_config.storage.root) / "models" / "champion") == champion

    small_config.train.max_steps = 200  # trained longer: better
    small_config.train.eval_every = 20
    packed, better = _trained(small_config, "better")
    third = evaluate_stage(small_config, packed, better)
    assert third.metrics["auc"] > third.promotion.champion_metrics["auc"]
    assert third.promotion.promoted, third.promotion.reason
    assert read_pointer(Path(small_config.storage.root) / "models" / "champion").sha256 == better.model.sha256


def test_crash_between_the_two_promotion_writes_keeps_a_consistent_champion(
    small_config: RetrainConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    packed, good = _trained(small_config, "good")
    evaluate_stage(small_config, packed, good)
    models = Path(small_config.storage.root) / "models"
    before = (models / "champion").read_bytes()

    import training.registry.champion as ev

    def crash(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt("killed between package copy and pointer swap")

    monkeypatch.setattr(ev, "write_json_atomic", crash)
    other = Path(good.run_dir)
    with pytest.raises(KeyboardInterrupt):
        promote(models, other / "model", ChampionPointer(sha256="f" * 64, run_key="x"))
    assert (models / "champion").read_bytes() == before
    pointer = json.loads(before)
    assert (models / pointer["sha256"] / "model.pt").exists()
    assert not [p for p in os.listdir(models) if ".tmp-" in p]


def _flip_a_byte(path: Path, offset: int = -64) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["weights", "model.json", "missing"])
def test_a_damaged_champion_is_found_before_training_and_never_blocks_retraining(
    small_config: RetrainConfig, damage: str
) -> None:
    from training.registry.champion import check_champion
    from training.storage.root import StorageRoot

    packed, good = _trained(small_config, "good")
    assert evaluate_stage(small_config, packed, good).promotion.promoted
    package = Path(small_config.storage.root) / "models" / good.model.sha256
    if damage == "weights":
        _flip_a_byte(package / "model.pt")
    elif damage == "model.json":
        # Valid JSON, still naming the right weights: only the package hash can tell.
        meta = json.loads((package / "model.json").read_text())
        meta["val_auc"] = 0.999
        (package / "model.json").write_text(json.dumps(meta))
    else:
        (package / "model.pt").unlink()
    champion = check_champion(StorageRoot.from_config(small_config), None)
    assert champion is not None and not champion.usable
    assert str(package) in champion.problem or "missing" in champion.problem

    small_config.train.max_steps = 40  # a shorter run: judged alone, against the target
    small_config.train.eval_every = 20
    small_config.eval.target_auc = 0.5
    packed, weak = _trained(small_config, "weak")
    evaluation = evaluate_stage(small_config, packed, weak)
    promotion = evaluation.promotion
    assert promotion.promoted, promotion.reason
    assert "unusable" in promotion.reason and "judged alone" in promotion.reason
    assert promotion.champion_problem == champion.problem
    healed = check_champion(StorageRoot.from_config(small_config), None)
    assert healed is not None and healed.usable and healed.sha256 == weak.model.sha256


def test_a_factory_named_by_storage_is_never_imported(small_config: RetrainConfig, tmp_path: Path) -> None:
    """Anyone who can write the root could name any importable callable in model.json."""
    from training.registry.champion import check_champion
    from training.storage.root import StorageRoot

    packed, good = _trained(small_config, "good")
    evaluate_stage(small_config, packed, good)
    models = Path(small_config.storage.root) / "models"
    pointer = json.loads((models / "champion").read_text())
    package = models / pointer["sha256"]
    marker = tmp_path / "ran"
    evil = tmp_path / "evil_factory.py"
    evil.write_text(f"import pathlib\ndef build(*a, **k):\n    pathlib.Path({str(marker)!r}).write_text('x')\n")
    meta = json.loads((package / "model.json").read_text())
    meta["model_config"]["factory"] = "evil_factory:build"
    (package / "model.json").write_text(json.dumps(meta))
    # An attacker rewrites the pointer's hash too: the hash is integrity, the factory rule is security.
    pointer["meta_sha256"] = __import__("hashlib").sha256((package / "model.json").read_bytes()).hexdigest()
    (models / "champion").write_text(json.dumps(pointer))
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        champion = check_champion(StorageRoot.from_config(small_config), None)
        assert champion is not None and not champion.usable and champion.recorded_metrics_only
        assert "never imported" in champion.problem
        evaluation = evaluate_stage(small_config, packed, good)
    finally:
        sys.path.remove(str(tmp_path))
    assert not marker.exists()
    assert "recorded test metrics" in evaluation.promotion.champion_note


def test_promotion_on_s3_is_a_compare_and_swap(
    small_config: RetrainConfig, s3_server: str, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two machines evaluate at once: the one whose comparison is stale must not overwrite the
    champion promoted a moment earlier (seen: 0.8366 overwrote 0.8410)."""
    import training.pipeline.evaluate_stage as stages
    from tests.conftest import s3_overrides
    from training.config import load_config
    from training.storage.root import StorageRoot

    packed, better = _trained(small_config, "better")
    small_config.train.max_steps = 3  # barely trained: worse
    small_config.train.eval_every = 3
    _, worse = _trained(small_config, "worse")

    def on_machine(name: str) -> RetrainConfig:
        return load_config(overrides=s3_overrides(s3_bucket, s3_server, tmp_path / name))

    def run_on(machine: str, trained: dict) -> dict:
        """The trained run as that machine's working copy holds it."""
        import shutil

        local = StorageRoot.from_config(on_machine(machine)).local / "runs" / trained.run_key
        shutil.copytree(trained.run_dir, local)
        return trained.model_copy(update={"run_dir": str(local)})

    real = stages._champion_metrics
    raced: list[dict] = []

    def meanwhile_another_machine_promotes(*args: object, **kwargs: object):
        if not raced:  # between machine A's comparison and its pointer swap
            monkeypatch.setattr(stages, "_champion_metrics", real)
            raced.append(evaluate_stage(on_machine("b"), packed, run_on("b", better)))
            monkeypatch.setattr(stages, "_champion_metrics", meanwhile_another_machine_promotes)
        return real(*args, **kwargs)

    monkeypatch.setattr(stages, "_champion_metrics", meanwhile_another_machine_promotes)
    slow = evaluate_stage(on_machine("a"), packed, run_on("a", worse))
    assert raced[0].promotion.promoted
    assert not slow.promotion.promoted, slow.promotion.reason
    assert slow.promotion.champion_sha256 == better.model.sha256  # compared again, with the new one
    root = StorageRoot.from_config(on_machine("c"))
    pointer_path, _ = root.fetch_versioned("models/champion")
    assert pointer_path is not None and json.loads(pointer_path.read_text())["sha256"] == better.model.sha256


def test_a_rerun_after_an_interrupted_report_reports_the_promotion_it_made(small_config: RetrainConfig) -> None:
    """SIGINT between the promotion and report.json: the rerun must not say "already the champion"."""
    packed, good = _trained(small_config, "good")
    first = evaluate_stage(small_config, packed, good)
    assert first.promotion.promoted
    again = evaluate_stage(small_config, packed, good)  # the rerun's evaluate task
    assert again.promotion == first.promotion
    (Path(good.run_dir) / "report.json").write_text("{}")  # a finished run: its rerun is no new promotion
    assert "already the champion" in evaluate_stage(small_config, packed, good).promotion.reason


def test_a_class_new_in_the_data_is_compared_on_the_classes_both_models_know(
        small_config: RetrainConfig, demo_source: Path, tmp_path: Path) -> None:
    """Classes grow in production. The champion knows mainstream, niche and premium; a new file
    adds bargain, which sorts first and so shifts every class index of the dataset. Evaluation
    scores the champion on the rows of its classes, in its own indices, compares the challenger on
    those same rows, and says so: no crash, no silently shifted labels."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from training.config import load_config
    from tests.conftest import small_overrides

    table = pq.read_table(demo_source)
    source = tmp_path / "src"
    source.mkdir()
    old = table.filter(pc.not_equal(table.column("segment"), "bargain"))
    pq.write_table(old, source / "day-0.parquet", row_group_size=2000)
    multiclass = ["data.task=multiclass", "data.label=segment", "data.vector=[embedding]", "train.max_steps=120"]
    config = load_config(overrides=[*small_overrides(tmp_path / "root", source), *multiclass])
    packed, champion = _trained(config, "champion")
    first = evaluate_stage(config, packed, champion)
    assert first.promotion.promoted and len(first.metrics) > 1

    pq.write_table(table.slice(0, 4000), source / "day-1.parquet", row_group_size=2000)
    packed, challenger = _trained(config, "challenger")
    second = evaluate_stage(config, packed, challenger)
    ours, theirs = second.metrics, second.promotion.champion_metrics
    assert theirs is not None and theirs["rows"] < ours["rows"]
    assert "bargain" in (second.promotion.champion_note or "")
    assert "classes both models know" in second.promotion.reason, second.promotion.reason
    # Scored in its own class indices, the champion does about as well as on its own test split.
    assert abs(theirs["accuracy"] - first.metrics["accuracy"]) < 0.1, (theirs, first.metrics)


def test_noise_never_replaces_the_champion_and_a_clearly_better_model_still_wins(small_config: RetrainConfig) -> None:
    """Two models that differ by their seed alone score within noise of each other on the same
    test rows: neither replaces the other, whichever is champion, even where the raw comparison
    would promote the one ahead by a hair. A clearly better model is promoted over a barely
    trained champion, and each decision carries its evidence (DeLong's interval for AUC)."""
    champion = Path(small_config.storage.root) / "models" / "champion"
    small_config.train.max_steps = 300
    packed, a = _trained(small_config, "seed-0")
    small_config.train.seed = 1
    packed, b = _trained(small_config, "seed-1")
    for champ, challenger in ((a, b), (b, a)):
        champion.unlink(missing_ok=True)
        assert evaluate_stage(small_config, packed, champ).promotion.promoted  # no champion yet
        twin = evaluate_stage(small_config, packed, challenger)
        assert not twin.promotion.promoted, twin.promotion.reason
        difference = twin.promotion.difference
        assert difference is not None and difference.method == "DeLong"
        assert difference.low < 0 < difference.high and "does not clear eval.min_delta" in twin.promotion.reason
    small_config.eval.promote_on = "point"  # the raw comparison: whichever is ahead by a hair wins
    ahead = twin.metrics["auc"] > twin.promotion.champion_metrics["auc"]  # type: ignore[index]
    assert evaluate_stage(small_config, packed, a).promotion.promoted == ahead

    small_config.eval.promote_on = "interval"
    small_config.train.max_steps = small_config.train.eval_every = 3  # barely trained: the champion to beat
    packed, weak = _trained(small_config, "weak")
    champion.unlink()
    assert evaluate_stage(small_config, packed, weak).promotion.promoted
    won = evaluate_stage(small_config, packed, a)
    assert won.promotion.promoted, won.promotion.reason
    assert won.promotion.difference is not None and won.promotion.difference.low > 0
