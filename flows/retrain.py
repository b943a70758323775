"""The retraining pipeline: pack (fanned out over segments) -> decide (anything to learn?) -> preprocess (cached)
-> train (resumable) -> evaluate -> report."""

from __future__ import annotations

import time

from prefect import flow

from tasks.decide import decide_training
from tasks.evaluate import evaluate_model, score_champion
from tasks.pack import pack_dataset
from tasks.policies import FLOW_TIMEOUTS, apply_credentials_block, backoff, train_timeout
from tasks.preprocess import preprocess_dataset
from tasks.report import StageEnds, StageStates, finished, keep_champion, write_report
from tasks.runtime import checked_columns, effective_config, flow_run_id, flow_run_name, one_writer_per_root
from tasks.train import find_champion, record_preemption, train_model
from training.config import RetrainConfig

__all__ = ["retrain"]


@flow(name="retrain", timeout_seconds=FLOW_TIMEOUTS.retrain, flow_run_name=flow_run_name, log_prints=True)
def retrain(config: RetrainConfig = RetrainConfig()) -> str:  # noqa: B008 - pydantic default renders in the UI
    """Retrain the model on the configured data; returns the path of the run's report.json (or of
    runs/kept/<flow run>.json when train.retrain_when found nothing to learn).

    Args:
        config: What to train and how (data, model, training, budgets, storage); merged key by
            key over the deployment's config, and pinned to the flow run at its first attempt.
    """
    ended = StageEnds(flow=time.time())  # for the report's phases
    config = effective_config(config)  # bounds the flow run's restarts too
    apply_credentials_block(config.storage)
    config = checked_columns(config)
    with one_writer_per_root(config.storage):
        packed = pack_dataset(config)
        ended.pack = time.time()
        decision = decide_training(config, packed)
        if not decision.train:
            return keep_champion(config, packed, decision, flow_run_id())
        prep_state = preprocess_dataset(config, packed)
        prep = prep_state.result()
        ended.preprocess = time.time()
        champion = find_champion(config)
        try:
            train_state = train_model.with_options(
                retries=config.train.retry.max_retries,
                retry_delay_seconds=backoff(config.train.retry.delay_seconds, config.train.retry.max_retries),
                timeout_seconds=train_timeout(config.budget.max_wall_seconds),
            )(config, packed, prep, champion, score_champion(config, packed) if config.budget.champion_gate else None,
              return_state=True)
        except BaseException:  # a termination signal unwinding the flow: a preempted task says so
            record_preemption()
            raise
        trained = train_state.result()
        ended.train = time.time()
        evaluation = evaluate_model(config, packed, trained)
        ended.evaluate = time.time()
        states = StageStates(pack="Completed", preprocess=str(prep_state.name), train=str(train_state.name),
                             evaluate="Completed")
        report = write_report(config, packed, prep, trained, evaluation, states, flow_run_id(), ended, decision)
        return finished(trained, report)  # type: ignore[return-value]  # a State: Prefect returns its data
