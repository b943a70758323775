"""The tuning study's Prefect side: each rung of each trial is a task run on the flow's task
runner (`tune.concurrency` at once), retried after a preemption like the train task; the
study's decisions are made in the flow (`training.tune.driver`)."""

from __future__ import annotations


from prefect import task
from prefect.futures import PrefectFuture, as_completed

from tasks.artifacts import publish_tune_report
from tasks.evaluate import evaluate_model
from tasks.policies import backoff, forward_child_event, retry_only_preemptions, task_logger
from tasks.report import write_report as write_run_report
from tasks.runtime import flow_run_id
from tasks.train import train_model
from training.config import RetrainConfig
from training.launch.events import ChildEvent
from training.pipeline.handoffs import PackResult, PrepResult, StageStates
from training.launch.results import RungResult
from training.tune.driver import base_comparison, drive, open_study
from training.tune.study import RungWork
from training.tune.study_report import TuneReport, write_report

__all__ = ["train_rung", "run_study", "promote_best"]


def _child_logger(event: ChildEvent) -> None:
    forward_child_event(task_logger(), event)


# No timeout: submitted, it runs in a worker thread of the task runner, where Prefect cannot
# interrupt it (and warns on every run); the flow's timeout bounds it.
@task(name="trial", task_run_name="trial-{trial}-to-step-{step}", retry_condition_fn=retry_only_preemptions)
def train_rung(config: RetrainConfig, packed: PackResult, prep: PrepResult, trial: str, step: int) -> RungResult:
    """Train one trial's run towards one rung in a child process (resumes its checkpoint);
    `trial` names it in the UI: its number, and `-seed-<n>` for a seed retrain."""
    from training.tune.trial import rung_stage

    return rung_stage(config, packed, prep, step, _child_logger)


def run_study(config: RetrainConfig, packed: PackResult, prep: PrepResult) -> tuple[TuneReport, str]:
    """Open (or resume) the study, train its rungs as task runs, write its report; returns the
    report and the path of tune_report.json."""
    logger = task_logger()
    study = open_study(config, packed, prep, _child_logger)
    rung = train_rung.with_options(retries=config.train.retry.max_retries,
                                   retry_delay_seconds=backoff(config.train.retry.delay_seconds,
                                                               config.train.retry.max_retries))

    def submit(work: RungWork) -> PrefectFuture[RungResult]:
        return rung.submit(work.config, packed, prep, work.label, work.step)

    def first_done(futures: list[PrefectFuture[RungResult]]) -> PrefectFuture[RungResult]:
        return next(iter(as_completed(futures)))

    drive(study, submit, first_done, logger.info)
    report, json_path, png = write_report(study, base_comparison(config, packed, _child_logger))
    publish_tune_report(report, png.read_bytes())
    return report, str(json_path)


def promote_best(config: RetrainConfig, packed: PackResult, prep: PrepResult, report: TuneReport) -> str:
    """The best trial's run through the usual pipeline end: train (it is finished already, or
    resumes from its last rung to full fidelity), evaluate, champion/challenger gate, report.
    Returns the run's report.json path."""
    assert report.best is not None
    best = config.with_values(report.best.params, "(tuning trial)")
    trained = train_model.with_options(
        retries=best.train.retry.max_retries,
        retry_delay_seconds=backoff(best.train.retry.delay_seconds, best.train.retry.max_retries),
    )(best, packed, prep)
    evaluation = evaluate_model(best, packed, trained)
    states = StageStates(pack="Completed", preprocess="Completed", train="Completed", evaluate="Completed")
    return write_run_report(best, packed, prep, trained, evaluation, states, flow_run_id())
