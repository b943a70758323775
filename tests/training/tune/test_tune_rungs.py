"""A tuning trial's run paused at its rungs is the run that was never paused."""

from __future__ import annotations

from training.config import RetrainConfig
from training.trainer.run import train
from training.protocol.results import RungResult, TrainResult

from tests.training.helpers import make_job


def test_a_run_paused_at_each_rung_ends_bit_identical_to_one_never_paused(small_config: RetrainConfig) -> None:
    reference = train(make_job(small_config, "reference"))
    assert isinstance(reference, TrainResult)
    job = make_job(small_config, "paused")
    for rung in (20, 40):
        job.pause_at = rung
        paused = train(job)
        assert isinstance(paused, RungResult) and (paused.status, paused.step) == ("paused", rung)
        # What the pruner sees: the best validation metric so far, as the reference had it there.
        assert paused.value == max(v["auc"] for v in reference.history if v.step <= rung)
        assert train(job) == paused  # asked again (a replay after a kill): the same pause, nothing trained
    job.pause_at = None
    final = train(job)
    assert isinstance(final, TrainResult)
    assert final.model.sha256 == reference.model.sha256 and final.history == reference.history
    # Pauses are planned stops, not preemptions; the run resumed from each rung's checkpoint.
    assert final.preemptions == 0 and final.resumed_from_steps == [20, 40]
