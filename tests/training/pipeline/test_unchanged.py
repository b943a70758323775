"""`training.pipeline.unchanged`: a finished run is found again only while nothing its outcome depends on
has changed (config, source bytes, champion, code), and never when a rerun would do something."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import small_overrides
from training.config import RetrainConfig, load_config
from training.data.ingest.source_index import SourceIndex, known_fingerprints
from training.data.ingest.sources import open_source
from training.pipeline.evaluate_stage import evaluate_stage
from training.pipeline.pack_stage import pack_stage
from training.pipeline.preprocess_stage import preprocess_stage
from training.pipeline.handoffs import StageStates
from training.pipeline.report_stage import report_stage
from training.pipeline.train_stage import train_stage
from training.registry.champion import champion_of
from training.pipeline.unchanged import find_unchanged


def _run_all(config: RetrainConfig) -> Path:
    packed = pack_stage(config)
    source = open_source(packed.source)
    index = SourceIndex(Path(config.storage.root) / "datasets" / "source-index.json")
    assert packed.fingerprint in known_fingerprints(index, config.data, source.uri, source.files())
    prep = preprocess_stage(packed.dataset_dir, config.preprocess, config.storage)
    trained = train_stage(config, packed, prep, champion_of(config))
    evaluation = evaluate_stage(config, packed, trained)
    return Path(report_stage(config, packed, prep, trained, evaluation, StageStates()).report)


def _config(root: Path, source: Path, *extra: str) -> RetrainConfig:
    return load_config(overrides=[*small_overrides(root, source), "train.max_steps=20", *extra])


def test_a_finished_run_is_found_until_its_config_data_or_champion_change(tmp_path: Path, demo_source: Path) -> None:
    source = tmp_path / "src.parquet"
    shutil.copy(demo_source, source)
    config = _config(tmp_path / "root", source)
    report = _run_all(config)
    found = find_unchanged(config)
    assert found is not None and found.report == report
    assert found.run_key == json.loads(report.read_text())["run_key"]

    assert find_unchanged(_config(tmp_path / "root", source, "train.optim.lr=0.01")) is None  # another config
    assert find_unchanged(_config(tmp_path / "root", source, "eval.min_delta=0.5")) is None  # not a train key either

    champion = tmp_path / "root" / "models" / "champion"
    pointer = champion.read_text()
    champion.write_text(json.dumps({**json.loads(pointer), "sha256": "0" * 64}))  # promoted elsewhere since
    assert find_unchanged(config) is None
    champion.write_text(pointer)
    assert find_unchanged(config) is not None

    # The same file name with other bytes is another dataset.
    import pyarrow.parquet as pq

    table = pq.read_table(source)
    pq.write_table(table.slice(0, table.num_rows - 1), source)
    assert find_unchanged(config) is None


def test_no_record_when_a_rerun_would_warm_start_from_the_model_it_promoted(tmp_path: Path, demo_source: Path) -> None:
    config = _config(tmp_path / "root", demo_source, "train.init_from=champion")
    _run_all(config)  # promoted (no champion yet): a rerun trains from it, another run
    assert find_unchanged(config) is None
    assert not (tmp_path / "root" / "runs" / "unchanged").exists()


def test_a_damaged_champion_or_a_missing_report_is_not_unchanged(tmp_path: Path, demo_source: Path) -> None:
    config = _config(tmp_path / "root", demo_source)
    report = _run_all(config)
    pointer = json.loads((tmp_path / "root" / "models" / "champion").read_text())
    meta = tmp_path / "root" / "models" / pointer["sha256"] / "model.json"
    original = meta.read_bytes()
    meta.write_bytes(original + b" ")
    assert find_unchanged(config) is None  # the flow's own check reports the damage
    meta.write_bytes(original)
    report.unlink()
    assert find_unchanged(config) is None


def test_the_cli_finds_it_without_loading_prefect_torch_or_pyarrow() -> None:
    code = ("import sys, retrain_cli.main, training.pipeline.unchanged; "
            "print(sorted(m for m in ('torch', 'prefect', 'pyarrow', 'boto3') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[3])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_retrain_flow_starts_without_torch() -> None:
    """torch loads in the stage that first needs it (a champion's check, or evaluation)."""
    out = subprocess.run([sys.executable, "-c", "import sys, flows.retrain; print('torch' in sys.modules)"],
                         capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[3])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
