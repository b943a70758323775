"""Running a study: price it (calibration), refuse a budget that cannot pay for one rung, then
keep `tune.concurrency` rungs in flight until the study is complete or out of budget.

The rungs run wherever `submit` sends them: Prefect task runs on the flow's task runner in the
`tune` flow, or anything with futures. Decisions stay here, in one process, in journal order.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Protocol, TypeVar

from training.config import RetrainConfig
from training.pipeline.handoffs import PackResult, PrepResult
from training.protocol.events import ChildEvent
from training.protocol.results import RungResult
from training.storage.files import write_json_atomic
from training.storage.root import RUN, StorageRoot
from training.tune.study import RungCost, RungWork, Study, study_key, study_rel
from training.tune.trial import TRIAL_CHILDREN, calibrate, read_calibration
from training.model.paired import PairedDifference
from training.copies import updated

__all__ = ["base_comparison", "open_study", "drive"]

log = logging.getLogger(__name__)


Future = TypeVar("Future", bound="_Future")  # a Prefect future of a rung, or any future alike


class _Future(Protocol):
    def result(self) -> RungResult: ...


def open_study(config: RetrainConfig, packed: PackResult, prep: PrepResult,
               on_event: Callable[[ChildEvent], None]) -> Study:
    """The study of this config and data, created or resumed, with this attempt's set-up time
    counted; raises ConfigError before any trial when the budget cannot pay for one rung."""
    TRIAL_CHILDREN.size = config.tune.concurrency
    try:
        return _open_study(config, packed, prep, on_event)
    except BaseException:
        TRIAL_CHILDREN.close()  # the calibration's child, kept warm for a study that will not run
        raise


def _open_study(config: RetrainConfig, packed: PackResult, prep: PrepResult,
                on_event: Callable[[ChildEvent], None]) -> Study:
    given, config = config, _resolved(config, packed)
    from training.pipeline.stage_calls import space_fit_in_child

    space_fit_in_child(config, packed, prep, on_event)  # torch: in the stage child, never the flow's process
    root = StorageRoot.from_config(config)
    key = study_key(config, packed.fingerprint)
    rel = f"{study_rel(key)}/calibration.json"
    path = root.fetch(rel) or root.path(rel)
    calibration = read_calibration(path, min(config.tune.calibration_steps, config.train.max_steps))
    fresh = calibration is None
    if calibration is None:
        calibration = calibrate(config, packed, prep, key, on_event)
    study = Study(config, packed.fingerprint, calibration.cost, given, packed.train_rows)
    if fresh:
        study.add_setup_seconds(calibration.billed_seconds, "calibration")
        write_json_atomic(path, calibration.model_dump())
        root.publish(rel, RUN)
    study.add_setup_seconds(packed.seconds + prep.seconds, "setup")
    if study.budget.unpriced:
        log.warning("%s cannot bind: cost.instance_type %s has no %s; set cost.instance_type and cost.market",
                    ", ".join(study.budget.unpriced), config.cost.instance_type,
                    "price" if study.budget.rate == 0 else "GPUs")
    # The hours first: a budget refused for its first rung is then refused with the reason a
    # bigger budget may be the wrong answer (a CPU pricing a model meant for a GPU).
    _warn_of_hours(config, calibration.cost, calibration.device)
    study.check_first_rung()
    return study


SLOW_TRIAL_SECONDS = 3600.0  # a trial at full fidelity longer than this on a CPU is worth a word


def _warn_of_hours(config: RetrainConfig, cost: RungCost, device: str | None) -> None:
    """One line, before any trial, when one trial at full fidelity takes hours on this CPU (the
    text model at its defaults takes seconds a step on a few cores; a GPU, milliseconds)."""
    seconds = cost.of(config.train.max_steps)
    if device == "cpu" and seconds > SLOW_TRIAL_SECONDS:
        log.warning("one trial at full fidelity takes about %.1f h on this machine's CPU (%.0f ms a step, "
                    "train.max_steps %d): `retrain plan` prices it on a GPU, or lower train.max_steps and the "
                    "model's size for a first study", seconds / 3600, cost.seconds_per_step * 1000,
                    config.train.max_steps)


def _resolved(config: RetrainConfig, packed: PackResult) -> RetrainConfig:
    """The study's config with train.eval_every and train.patience resolved for this data: the
    rungs are multiples of the validation interval."""
    from training.errors import ConfigError
    from training.search_space import SpaceError
    from training.tune.rungs import check_rungs

    resolved = config.for_train_rows(packed.train_rows)
    try:
        check_rungs(resolved)
    except SpaceError as err:
        raise ConfigError(f"{err} (train.eval_every auto is {resolved.train.validate_every} for this dataset)") from None
    return resolved


def check_space_fits(config: RetrainConfig, prep: PrepResult) -> None:
    """Before any trial: the largest model the space can sample fits this machine's memory (in
    the stage child: `space_fit_in_child`)."""
    from training.data.prepare.features import FeatureStats
    from training.model.memory_fit import check_space_fits
    from training.model.network import ModelSchema
    from training.trainer.precision import resolve_device

    stats = FeatureStats.from_json(Path(prep.stats_path).read_text())
    check_space_fits(config, ModelSchema.of(stats), resolve_device(config.train.device))


def base_comparison(config: RetrainConfig, packed: PackResult, on_event: Callable[[ChildEvent], None]
                    ) -> Callable[[str, str, float], PairedDifference]:
    """Two finished trials' models compared on the validation split, with an interval at the
    confidence asked, in a child process (torch): what `study_report.against_base` asks."""
    def compare(challenger: str, base: str, confidence: float) -> PairedDifference:
        from training.pipeline.stage_calls import compare_in_child
        from training.protocol.runs import fetch_finished_run, run_rel

        root = StorageRoot.from_config(config)
        folders = []
        for key in (challenger, base):
            if root.remote is not None:
                fetch_finished_run(root, run_rel(key))  # a trial finished on another machine
            folders.append(root.path(f"{run_rel(key)}/model"))
        asked = updated(config, {"eval": updated(config.eval, {"confidence": confidence})})
        return compare_in_child(asked, packed, folders[0], folders[1], on_event)

    return compare


def drive(study: Study, submit: Callable[[RungWork], Future], first_done: Callable[[list[Future]], Future],
          say: Callable[[str], None] = log.info) -> None:
    """Hand out rungs until none is left; record each outcome as it arrives."""
    try:
        _drive(study, submit, first_done, say)
    finally:
        TRIAL_CHILDREN.close()
    if study.stopped_by:
        say(f"study stopped by its budget: {study.stopped_by}")
    if study.seeds_skipped:
        say(f"seed retrains skipped: {study.seeds_skipped}")


def _drive(study: Study, submit: Callable[[RungWork], Future], first_done: Callable[[list[Future]], Future],
           say: Callable[[str], None]) -> None:
    running: dict[Any, RungWork] = {}
    while True:
        while len(running) < study.tune.concurrency:
            work = study.next_work()
            if work is None:
                break
            to = (f"retraining with seed {work.config.train.seed} to step {work.step}" if work.repeat
                  else f"training to step {work.step} (rung {work.rung})")
            say(f"trial {work.trial} {json.dumps(work.params, sort_keys=True)}: {to}, "
                f"priced at ${study.budget.usd(work.price_seconds):.6f}")
            running[submit(work)] = work
        if not running:
            break
        done = first_done(list(running))
        work = running.pop(done)
        outcome = done.result()
        study.record(work, outcome)
        frozen = study.study.get_trials(deepcopy=False)[work.trial]
        if work.repeat:
            last = outcome.last_value if outcome.last_value is not None else outcome.value
            say(f"trial {work.trial} seed {work.config.train.seed} at step {outcome.step}: last val {study.metric} "
                f"{last:.4f} ({outcome.status}); spent ${study.budget.usd(study.spent_seconds()):.6f} "
                f"({study.spent_seconds():.1f} machine-s)")
            continue
        if frozen.state.name == "RUNNING":
            state = "waiting at its rung" if study.deferred else "promoted"
        else:
            state = frozen.user_attrs.get("status", outcome.status)
        say(f"trial {work.trial} at step {outcome.step}: val {study.metric} {outcome.value:.4f} -> {state}; "
            f"spent ${study.budget.usd(study.spent_seconds()):.6f} ({study.spent_seconds():.1f} machine-s)")
