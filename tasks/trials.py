"""The tuning study's Prefect side: each rung of each trial is a task run on the flow's task
runner (`tune.concurrency` at once), retried after a preemption like the train task; the
study's decisions are made in the flow (`training.tune.driver`)."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.futures import PrefectFuture, as_completed

from tasks.artifacts import publish_tune_report
from tasks.evaluate import evaluate_model
from tasks.policies import backoff, forward_child_event, retry_only_preemptions, task_logger
from tasks.report import write_report as write_run_report
from tasks.runtime import flow_run_id
from tasks.train import find_champion, train_model
from training.config import RetrainConfig
from training.pipeline.handoffs import PackResult, PrepResult, StageStates
from training.pipeline.reports.run_report import RunReport
from training.protocol.events import ChildEvent
from training.protocol.results import RungResult
from training.registry.champion import has_champion
from training.storage.root import StorageRoot
from training.tune.driver import base_comparison, drive, open_study
from training.tune.study import RungWork
from training.tune.study_report import StudyGate, TuneReport, record_gate, write_report

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


def promote_best(config: RetrainConfig, packed: PackResult, prep: PrepResult, report: TuneReport) -> TuneReport:
    """The study's answer through the usual pipeline end: train (its run is finished already),
    evaluate, champion/challenger gate, report. In a root with no champion yet, the config as
    given goes through first: a run of it is what the root would otherwise serve, so an answer
    that differs from it must beat it on the test split by the paired interval, as any
    challenger must. Returns the study's report with the gate's decision (also written to
    tune_report.json)."""
    best = report.best
    assert best is not None
    root = StorageRoot.from_config(config)
    base = next((row for row in report.trials if row.base and row.run_key), None)
    base_first = base is not None and base.number != best.trial and not has_champion(root)
    if base_first:
        assert base is not None
        task_logger().info("no champion yet: the config as given (trial %d) goes through the gate first, so trial %d "
                           "is promoted only if it beats it on test", base.number, best.trial)
        _through_gate(config.with_values(base.params, "(tuning: the config as given)"), packed, prep)
    path = _through_gate(config.with_values(best.params, "(tuning trial)"), packed, prep)
    promotion = RunReport.read(Path(path)).promotion
    return record_gate(root, report, StudyGate(trial=best.trial, promoted=promotion.promoted, reason=promotion.reason,
                                               report=path, base_first=base_first))


def _through_gate(config: RetrainConfig, packed: PackResult, prep: PrepResult) -> str:
    trained = train_model.with_options(
        retries=config.train.retry.max_retries,
        retry_delay_seconds=backoff(config.train.retry.delay_seconds, config.train.retry.max_retries),
    )(config, packed, prep, find_champion(config))
    evaluation = evaluate_model(config, packed, trained)
    states = StageStates(pack="Completed", preprocess="Completed", train="Completed", evaluate="Completed")
    return write_run_report(config, packed, prep, trained, evaluation, states, flow_run_id())
