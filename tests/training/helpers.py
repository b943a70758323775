"""Builds a ready-to-train job from a config, through the same stage functions the flow uses."""

from __future__ import annotations


from training.protocol.events import ChildEvent
from training.config import RetrainConfig
from training.protocol.job import TrainJob
from training.storage.root import StorageRoot
from training.pipeline.pack_stage import pack_stage
from training.pipeline.preprocess_stage import preprocess_stage
from training.protocol.numerics import job_numerics
from training.pipeline.train_stage import run_key_for


def make_job(config: RetrainConfig, run_name: str | None = None) -> TrainJob:
    packed = pack_stage(config)
    prep = preprocess_stage(packed.dataset_dir, config.preprocess, config.storage, config.cost.tags)
    run_key = run_key_for(config, packed.fingerprint)
    root = StorageRoot.from_config(config)
    rel = f"runs/{run_name or run_key}"
    return TrainJob(
        run_key=run_key,
        run_dir=str(root.local / rel),
        run_rel=rel if root.is_remote else "",
        dataset_dir=packed.dataset_dir,
        stats_path=prep.stats_path,
        config=config,
        numerics=list(job_numerics(config)),
    )


def _same_threads(config: RetrainConfig) -> RetrainConfig:
    """`config` with one torch thread. A run keeps the thread count of its first start across
    resumes, but two runs started at different load may pick different counts ("auto"), and then
    their validation metrics differ in the last bits (the weights do not): the reference must
    run as the interrupted run does."""
    config = config.model_copy(deep=True)
    config.train.loader.torch_threads = 1
    return config


def assert_resumes_bit_identically(config: RetrainConfig, stop_at: int = 50) -> None:
    """A run stopped at its checkpoint `stop_at` and resumed ends with the weights and history
    of the run that was never stopped."""
    import pytest

    from training.errors import Preempted
    from training.trainer.run import StopFlag, train

    config = _same_threads(config)
    reference = train(make_job(config, "reference"))
    job = make_job(config, "interrupted")
    stop = StopFlag()

    def emit(event: ChildEvent) -> None:
        if event.event == "checkpoint" and event.step == stop_at:
            stop.request("test")

    with pytest.raises(Preempted):
        train(job, stop, emit)
    resumed = train(job)
    assert resumed.model.sha256 == reference.model.sha256
    got, want = [h.to_json() for h in resumed.history], [h.to_json() for h in reference.history]
    assert got == want, f"history after the stop at step {stop_at}:\n{got}\nuninterrupted:\n{want}"


def assert_resumes_bit_identically_after_a_sigkill(config: RetrainConfig, kill_at: int) -> None:
    """The real thing: the training child process killed with SIGKILL at step `kill_at`, then rerun."""
    import signal

    import pytest

    from tests.training.trainer.test_preemption import _signal_at_step
    from training.errors import Preempted
    from training.launch.process import run_training_process

    config = _same_threads(config)
    reference = run_training_process(make_job(config, "reference"))
    job = make_job(config, "killed")
    on_start, seen = _signal_at_step(job, kill_at, signal.SIGKILL)
    with pytest.raises(Preempted, match="SIGKILL"):
        run_training_process(job, on_start=on_start)
    final = run_training_process(job)
    assert seen["step"] >= kill_at and final.preemptions == 1
    assert final.model.sha256 == reference.model.sha256
    # This module's asserts are not rewritten by pytest: the message is what a failure shows.
    got, want = [h.to_json() for h in final.history], [h.to_json() for h in reference.history]
    assert got == want, f"history after the SIGKILL at step {seen['step']}:\n{got}\nuninterrupted:\n{want}"
