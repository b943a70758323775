"""The tuning study's answer at test time (tune.promote, on by default), under the Prefect test
server: in a root with no champion, an answer that differs from the config as given must beat
a run of that config on the test split, as any challenger beats a champion; it is not promoted
merely because the root was empty. The study's rows come from a table here; both runs and the
gate are real."""

from __future__ import annotations

import json
from pathlib import Path

from prefect import flow

from tasks.pack import pack_dataset
from tasks.preprocess import preprocess_dataset
from tasks.trials import promote_best
from tests.conftest import small_overrides
from training.config import RetrainConfig, load_config
from training.tune.study_report import BestTrial, Spend, StudyBudget, TrialRow, TuneReport


@flow(name="tune-gate-test")
def _gate(config: RetrainConfig, report: TuneReport) -> TuneReport:
    packed = pack_dataset(config)
    prep = preprocess_dataset(config, packed).result()
    return promote_best(config, packed, prep, report)


def _row(number: int, lr: float, value: float, base: bool) -> TrialRow:
    return TrialRow(number=number, params={"train.optim.lr": lr}, state="completed", rung=0, steps=60, value=value,
                    rung_values={}, billed_seconds=1.0, usd=0.0, gpu_hours=0.0, steps_lost=0, preemptions=0,
                    run_key=f"run-{number}", base=base, last_value=value, score=value)


def test_in_an_empty_root_a_worse_answer_is_not_promoted_over_the_config_as_given(tmp_path: Path,
                                                                                   demo_source: Path) -> None:
    config = load_config(overrides=[*small_overrides(tmp_path / "root", demo_source), "train.patience=0",
                                    "train.loader.num_workers=0", "train.loader.torch_threads=1"])
    default_lr = config.train.optim.lr
    # Trial 7 "won" on validation (a lucky split, say) with a learning rate that trains next to
    # nothing in 60 steps: on test it is clearly worse than the defaults.
    spend = Spend(seconds=2.0, usd=0.0, gpu_hours=0.0, setup_seconds={})
    report = TuneReport(
        study="gate", status="complete", stop_reason=None, metric="auc", direction="maximize", rungs=[60],
        instance_type="local-cpu", market="on_demand", rate_per_hour=0.0,
        trials=[_row(0, default_lr, 0.80, base=True), _row(7, 1e-7, 0.81, base=False)], spend=spend,
        budget=StudyBudget(), naive=spend, saved_fraction=0.0,
        best=BestTrial(trial=7, value=0.81, params={"train.optim.lr": 1e-7}, run_key="run-7", config="best.yaml"))
    (tmp_path / "root" / "tune" / "gate").mkdir(parents=True)

    gated = _gate(config, report)

    assert gated.gate is not None and gated.gate.trial == 7 and gated.gate.base_first
    assert not gated.gate.promoted, gated.gate.reason
    answer = json.loads(Path(gated.gate.report).read_text())
    champion = json.loads((tmp_path / "root" / "models" / "champion").read_text())
    # The config as given holds the root; the answer was compared with it, row by row.
    assert champion["sha256"] != answer["model"]["sha256"]
    assert answer["promotion"]["champion_sha256"] == champion["sha256"]
    assert answer["promotion"]["difference"] is not None
    written = TuneReport.read(tmp_path / "root" / "tune" / "gate" / "tune_report.json")
    assert written.gate == gated.gate
