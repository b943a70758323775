from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.training.helpers import make_job
from training.protocol.events import ChildEvent
from training.config import RetrainConfig
from training.errors import CheckpointError, Preempted
from training.trainer.run import StopFlag, train


def _stop_after_checkpoint(at_step: int, stop: StopFlag):
    def emit(event: ChildEvent) -> None:
        if event.event == "checkpoint" and event.step == at_step:
            stop.request("test")

    return emit


def test_train_completes_and_exports_a_model(small_config: RetrainConfig) -> None:
    result = train(make_job(small_config))
    assert result.status == "completed" and result.steps == 60
    assert len(result.model.sha256) == 64
    assert Path(result.model.uri).exists()
    assert [v.step for v in result.history] == [20, 40, 60]
    assert result.best_val_auc > 0.6


def test_resume_after_stop_is_bit_identical(small_config: RetrainConfig, tmp_path: Path) -> None:
    reference = train(make_job(small_config, "reference"))
    job = make_job(small_config, "interrupted")
    for at in (20, 40):
        stop = StopFlag()
        with pytest.raises(Preempted):
            train(job, stop, _stop_after_checkpoint(at, stop))
    resumed = train(job)
    assert resumed.model.sha256 == reference.model.sha256
    assert resumed.history == reference.history
    assert resumed.resumed_from_steps == [20, 40]
    assert resumed.preemptions == 2


def test_workers_change_nothing_but_speed(small_config: RetrainConfig) -> None:
    reference = train(make_job(small_config, "w0"))
    small_config.train.loader.num_workers = 2
    with_workers = train(make_job(small_config, "w2"))
    assert with_workers.model.sha256 == reference.model.sha256


def test_the_split_held_on_the_device_trains_the_streamed_model_and_resumes_bit_identically(
        small_config: RetrainConfig) -> None:
    """train.loader.resident gathers each batch from the whole split held on the device (here the
    CPU, through the same code): the same rows in the same order as streaming, so the same
    model, across epochs (60 steps of 128 rows are more than one) and across a resume."""
    from tests.training.helpers import assert_resumes_bit_identically

    small_config.train.loader.num_workers = 0
    small_config.train.loader.resident = False  # "auto" holds this split on a GPU
    streamed = train(make_job(small_config, "streamed"))
    small_config.train.loader.resident = True
    held = train(make_job(small_config, "held"))
    assert held.model.sha256 == streamed.model.sha256 and held.history == streamed.history
    assert held.num_workers.resident and not streamed.num_workers.resident
    assert_resumes_bit_identically(small_config, stop_at=40)


def test_early_stopping_patience_survives_a_resume(small_config: RetrainConfig) -> None:
    small_config.train.max_steps = 400
    small_config.train.eval_every = 10
    small_config.train.checkpoint.every = 10
    small_config.train.patience = 3
    small_config.train.min_delta = 0.5  # nothing improves by 0.5 AUC: stops after 3 bad evals
    reference = train(make_job(small_config, "ref"))
    assert reference.status == "early_stopped"
    assert reference.steps == 40  # best at 10, then 20, 30, 40 without improvement
    job = make_job(small_config, "resumed")
    stop = StopFlag()
    with pytest.raises(Preempted):
        train(job, stop, _stop_after_checkpoint(30, stop))
    state = json.loads((Path(job.run_dir) / "checkpoints" / "step-00000030" / "manifest.json").read_text())
    assert state["step"] == 30
    resumed = train(job)
    assert resumed.status == "early_stopped" and resumed.steps == 40  # counter continued, not restarted


def test_checkpoint_of_another_config_is_refused(small_config: RetrainConfig) -> None:
    job = make_job(small_config, "shared")
    stop = StopFlag()
    with pytest.raises(Preempted):
        train(job, stop, _stop_after_checkpoint(20, stop))
    small_config.train.optim.lr = 0.5
    other = make_job(small_config, "shared")
    with pytest.raises(CheckpointError, match="belongs to run"):
        train(other)


def test_finished_run_is_not_trained_again(small_config: RetrainConfig) -> None:
    job = make_job(small_config)
    first = train(job)
    again = train(job)
    assert again.already_complete and again.model == first.model


def test_grad_accumulation_matches_one_big_batch(small_config: RetrainConfig) -> None:
    big = train(make_job(small_config, "big"))
    small_config.train.batch_size = 64
    small_config.train.grad_accum = 2
    accumulated = train(make_job(small_config, "accum"))
    # Same rows per optimizer step, loss divided by the accumulation steps: same training up to
    # float summation order.
    assert big.history and len(big.history) == len(accumulated.history)
    for a, b in zip(big.history, accumulated.history, strict=True):
        assert abs(a["auc"] - b["auc"]) < 2e-3


@pytest.mark.parametrize("interval", ["auto", "0.05s"])
def test_time_based_checkpoint_intervals(small_config: RetrainConfig, interval: str) -> None:
    small_config.train.max_steps = 200
    small_config.train.eval_every = 100
    small_config.train.checkpoint.every = interval
    # Tiny, so auto saves often here: its interval is sqrt(2 x save cost x this), and the save
    # cost is measured at step 100's save, so steps 100-200 must outlast one interval (with 0.5,
    # about 0.1-0.2 s, a clean-clone CI run trained them faster than that once).
    small_config.train.checkpoint.mean_seconds_between_preemptions = 0.005
    result = train(make_job(small_config))
    described = result.checkpoint_interval
    assert described is not None
    assert described.mode == ("auto" if interval == "auto" else "seconds")
    assert described.seconds is not None and described.seconds > 0
    # more saves than the validation-triggered ones (steps 100 and 200)
    assert result.checkpoints_saved > 2
    if interval == "auto":
        expected = (2 * described.save_cost_seconds * 0.005) ** 0.5
        assert described.seconds == pytest.approx(expected)


def test_checkpoint_interval_is_validated() -> None:
    from training.config import load_config
    from training.errors import ConfigError

    assert load_config(overrides=["train.checkpoint.every=90s"]).train.checkpoint.interval() == ("seconds", 90.0)
    assert load_config(overrides=["train.checkpoint.every=auto"]).train.checkpoint.interval() == ("auto", 0.0)
    with pytest.raises(ConfigError, match="train.checkpoint.every"):
        load_config(overrides=["train.checkpoint.every=soon"])
    with pytest.raises(ConfigError, match="train.checkpoint.every"):
        load_config(overrides=["train.checkpoint.every=0"])


def test_profile_records_a_trace_and_top_ops(small_config: RetrainConfig) -> None:
    small_config.train.profile = True
    result = train(make_job(small_config))
    profile = result.profile
    assert profile is not None
    assert Path(profile.trace).stat().st_size > 0
    assert profile.steps == 10 and profile.after_steps == 10
    names = [op.name for op in profile.top_ops]
    assert any("addmm" in n or "linear" in n or "mm" in n for n in names), names


def test_the_steady_step_time_leaves_the_warm_up_out() -> None:
    from training.trainer.trainer import steady_step_seconds

    assert steady_step_seconds([0.5] * 9) is None
    warm = [0.200, 0.050, 0.030] + [0.010] * 47  # the first steps pay the warm-up
    assert steady_step_seconds(warm) == pytest.approx(0.010)
    assert sum(warm) / len(warm) > 1.4 * 0.010  # what the plan's calibration took per step before
