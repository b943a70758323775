"""`training.pipeline.stage_calls` (answered by `training.worker.stage`): evaluation, promotion and the champion gate run in a child
process, so that the flow's process runs a first retraining (no champion to verify yet) without
importing torch; the child's result is the in-process stage's, and its errors cross as the same
classes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import small_overrides
from training.config import RetrainConfig
from training.errors import DataError
from training.pipeline.evaluate_stage import champion_validation_metric, evaluate_stage
from training.pipeline.pack_stage import pack_stage
from training.pipeline.preprocess_stage import preprocess_stage
from training.pipeline.stage_calls import champion_metric_in_child, evaluate_in_child
from training.pipeline.train_stage import train_stage
from training.registry.champion import champion_of

ROOT = Path(__file__).resolve().parents[3]

# The stages as the flow runs them, in a process where `import torch` fails.
_WITHOUT_TORCH = textwrap.dedent("""
    import json, sys
    sys.modules["torch"] = None
    from training.config import load_config
    from training.pipeline.handoffs import StageStates
    from training.pipeline.pack_stage import pack_stage
    from training.pipeline.preprocess_stage import preprocess_stage
    from training.pipeline.report_stage import report_stage
    from training.pipeline.stage_calls import champion_metric_in_child, evaluate_in_child
    from training.pipeline.train_stage import train_stage
    from training.registry.champion import champion_of

    config = load_config(overrides=json.loads(sys.argv[1]))
    packed = pack_stage(config)
    prep = preprocess_stage(packed.dataset_dir, config.preprocess, config.storage)
    no_champion = champion_metric_in_child(config, packed)
    trained = train_stage(config, packed, prep, champion_of(config))
    evaluation = evaluate_in_child(config, packed, trained)
    gate = champion_metric_in_child(config, packed)
    report = report_stage(config, packed, prep, trained, evaluation, StageStates())

    # New rows arrive; the champion is scored on them for drift (train.retrain_when), in the stage child.
    import shutil
    shutil.copy(sys.argv[3], config.data.source)
    from training.pipeline.decide_stage import decide_stage
    decision = decide_stage(config.with_values({"train.retrain_when": "drift"}, "test"), pack_stage(config))

    # A tuning study's opening: the space's memory check and the calibration, in children.
    from training.protocol.events import LogLine
    from training.tune.driver import open_study
    tune = load_config(overrides=json.loads(sys.argv[1]) + [
        "tune.space={'train.optim.lr': 'loguniform(1e-4, 1e-2)'}", "tune.max_trials=2", "tune.min_resource=20",
        "train.max_steps=60",
        "tune.calibration_steps=5"])
    study = open_study(tune, packed, prep, lambda event: None)

    # The run key on a machine with a GPU driver: nvidia-smi is asked, never torch.
    import os
    from training.protocol import numerics
    from training.pipeline.train_stage import run_key_for
    numerics.gpu_driver_present = lambda: True
    os.environ["PATH"] = sys.argv[2] + os.pathsep + os.environ["PATH"]
    key = run_key_for(config.with_values({"train.precision": "bf16"}, "test"), packed.fingerprint)
    print(json.dumps({"no_champion": no_champion, "promoted": evaluation.promotion.promoted, "gate": gate,
                      "auc": evaluation.metrics["auc"], "report": report.report,
                      "champion_new": decision.champion_metric_new, "new_rows": decision.new_rows,
                      "study": bool(study), "key": key, "numerics": numerics.job_numerics(config)}))
""")


def test_a_retraining_runs_in_a_process_that_cannot_import_torch(tmp_path: Path, demo_source: Path) -> None:
    import pyarrow.parquet as pq

    source = tmp_path / "source"
    source.mkdir()
    pq.write_table(pq.read_table(demo_source), source / "a.parquet")
    later = tmp_path / "b.parquet"  # the rows that arrive after the first training
    pq.write_table(pq.read_table(demo_source).slice(0, 2000), later)
    overrides = [*small_overrides(tmp_path / "root", source), "train.max_steps=20"]
    smi = tmp_path / "bin" / "nvidia-smi"  # a machine with a GPU driver: what the run key asks
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\necho 9.0\n")
    smi.chmod(0o755)
    out = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, json.dumps(overrides), str(smi.parent), str(later)],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["no_champion"] is None and result["promoted"]
    assert 0.5 < result["auc"] <= 1.0 and 0.5 < result["gate"] <= 1.0
    assert Path(result["report"]).is_file()
    assert result["new_rows"] and 0.5 < result["champion_new"] <= 1.0  # scored on the new rows, in the child
    assert result["study"] and result["numerics"] == ["cuda", "bf16"]  # nvidia-smi's 9.0: native bf16


def test_the_childs_evaluation_is_the_in_process_one(small_config: RetrainConfig) -> None:
    small_config.train.max_steps = 20
    packed = pack_stage(small_config)
    prep = preprocess_stage(packed.dataset_dir, small_config.preprocess, small_config.storage)
    trained = train_stage(small_config, packed, prep, champion_of(small_config))
    assert champion_metric_in_child(small_config, packed) is None
    there = evaluate_in_child(small_config, packed, trained)
    assert there.promotion.promoted and there.promotion.challenger_sha256 == trained.model.sha256
    here = evaluate_stage(small_config, packed, trained)  # the same run again, in this process
    assert here.metrics == there.metrics and here.promotion.promoted
    assert champion_metric_in_child(small_config, packed) == champion_validation_metric(small_config, packed)


def test_an_error_in_the_child_is_raised_here_as_the_same_class(small_config: RetrainConfig, tmp_path: Path) -> None:
    small_config.train.max_steps = 20
    packed = pack_stage(small_config)
    prep = preprocess_stage(packed.dataset_dir, small_config.preprocess, small_config.storage)
    trained = train_stage(small_config, packed, prep, champion_of(small_config))
    gone = packed.model_copy(update={"dataset_dir": str(tmp_path / "gone")})
    with pytest.raises(DataError, match="no manifest.json"):
        evaluate_in_child(small_config, gone, trained)
