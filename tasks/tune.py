"""The tuning study's Prefect side: each rung of each trial is a task run on the flow's task
runner (`tune.concurrency` at once), retried after a preemption like the train task; the
study's decisions are made in the flow (`training.tune.driver`)."""

from __future__ import annotations

import base64
import logging
from typing import Any

from prefect import task
from prefect.futures import PrefectFuture, as_completed

from tasks.artifacts import in_run
from tasks.evaluate import evaluate_model
from tasks.policies import backoff, retry_only_preemptions, task_logger
from tasks.report import write_report as write_run_report
from tasks.runtime import flow_run_id
from tasks.train import train_model
from training.config import RetrainConfig
from training.results import PackResult, PrepResult, RungResult
from training.tune.driver import drive, open_study
from training.tune.report import TuneReport, write_report
from training.tune.space import apply_params
from training.tune.study import RungWork

__all__ = ["train_rung", "run_study", "promote_best"]


def _child_logger(event: dict[str, Any]) -> None:
    logger = task_logger()
    if event["event"] == "log":
        level = logging.getLevelName(str(event.get("level", "WARNING")))
        logger.log(level if isinstance(level, int) else logging.WARNING, "%s", event.get("message", ""))
    elif event["event"] == "resumed":
        logger.info("resumed from step %d", event["step"])


@task(name="trial", task_run_name="trial-{trial}-to-step-{step}", retry_condition_fn=retry_only_preemptions)
def train_rung(config: RetrainConfig, packed: PackResult, prep: PrepResult, trial: int, step: int) -> RungResult:
    """Train one trial's run towards one rung in a child process (resumes its checkpoint)."""
    from training.tune.trial import rung_stage

    return rung_stage(config, packed, prep, step, _child_logger)


def _publish(report: TuneReport, png_bytes: bytes) -> None:
    if not in_run():
        return
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    rows = [{"trial": r.number, **{k: v for k, v in r.params.items()}, "state": r.state,
             "rung": r.rung, "steps": r.steps, report.metric: None if r.value is None else round(r.value, 5),
             "usd": round(r.usd, 6), "gpu_hours": round(r.gpu_hours, 6), "seconds": round(r.billed_seconds, 2)}
            for r in report.trials]
    create_table_artifact(rows, key="tune-trials", description=f"Trials of study {report.study}")
    best = report.best
    image = base64.b64encode(png_bytes).decode()
    create_markdown_artifact(
        f"### Study {report.study}: {report.status}\n\n"
        f"Spent ${report.spend.usd:.6f} ({report.spend.seconds:.1f} machine-s, {report.spend.gpu_hours:.6f} GPU-h) "
        f"against budget {report.budget}; every trial at full fidelity on demand would cost "
        f"${report.naive.usd:.6f}.\n\n"
        + (f"Best: trial {best['trial']}, validation {report.metric} {best['value']:.5f}, {best['params']}\n\n"
           if best else "No trial reached full fidelity.\n\n")
        + f"![metric against cumulative cost](data:image/png;base64,{image})\n",
        key="tune-report", description=f"Tuning study {report.study}")


def run_study(config: RetrainConfig, packed: PackResult, prep: PrepResult) -> tuple[TuneReport, str]:
    """Open (or resume) the study, train its rungs as task runs, write its report; returns the
    report and the path of tune_report.json."""
    logger = task_logger()
    study = open_study(config, packed, prep, _child_logger)
    rung = train_rung.with_options(retries=config.train.max_retries,
                                   retry_delay_seconds=backoff(config.train.retry_delay_seconds,
                                                               config.train.max_retries))

    def submit(work: RungWork) -> PrefectFuture[RungResult]:
        return rung.submit(work.config, packed, prep, work.trial, work.step)

    def first_done(futures: list[PrefectFuture[RungResult]]) -> PrefectFuture[RungResult]:
        return next(iter(as_completed(futures)))

    drive(study, submit, first_done, logger.info)
    report, json_path, png = write_report(study)
    _publish(report, png.read_bytes())
    return report, str(json_path)


def promote_best(config: RetrainConfig, packed: PackResult, prep: PrepResult, report: TuneReport) -> str:
    """The best trial's run through the usual pipeline end: train (it is finished already, or
    resumes from its last rung to full fidelity), evaluate, champion/challenger gate, report.
    Returns the run's report.json path."""
    assert report.best is not None
    best = apply_params(config, report.best["params"])
    trained = train_model.with_options(
        retries=best.train.max_retries,
        retry_delay_seconds=backoff(best.train.retry_delay_seconds, best.train.max_retries),
    )(best, packed, prep)
    evaluation = evaluate_model(best, packed, trained)
    states = {"pack": "Completed", "preprocess": "Completed", "train": "Completed", "evaluate": "Completed"}
    return write_run_report(best, packed, prep, trained, evaluation, states, flow_run_id())
