"""What a study reports: `tune_report.json` (trials, spend against budget, the naive
counterfactual, the best trial), `tune_curve.png` (best metric against cumulative cost) and
`best_config.yaml` (the best trial's config, for `retrain run --config`), all under
`tune/<study>/` and published with the root."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import yaml
from pydantic import BaseModel, ConfigDict

from training.config import metric_name
from training.search_space import TrialParams
from training.cost.bill import SECONDS_PER_HOUR
from training.storage.files import write_atomic, write_json_atomic
from training.storage.root import RUN, StorageRoot
from training.tune.study import Study, study_rel
from training.model.paired import PairedDifference
from training.copies import updated

__all__ = ["BestTrial", "StudyBudget", "StudyGate", "TrialRow", "TuneReport", "build_report", "record_gate",
           "write_report"]


class _Row(BaseModel):
    model_config = ConfigDict(frozen=True)


class TrialRow(_Row):
    number: int
    params: TrialParams
    state: str  # completed, early_stopped, pruned, budget (stopped by the study's budget), running, failed,
    # refused (its journal lines broke the journal's rules: never trained, never the best)
    rung: int | None  # index of the last rung reached (None: none yet)
    steps: int
    value: float | None  # the metric at the last rung reached (or the finished run's best)
    rung_values: dict[int, float]
    billed_seconds: float
    usd: float
    gpu_hours: float
    steps_lost: int
    preemptions: int
    run_key: str | None
    finished_at: str | None = None  # when the trial completed or was pruned (ISO 8601); None: still open
    spent_at: float | None = None  # the study's machine seconds when the trial's last rung ended
    base: bool = False  # the config as given (the study's first trial)
    last_value: float | None = None  # a finished trial's last validation (what it ranks by)
    seed_values: list[float] = []  # the last validations of its seed retrains (tune.seeds), in seed order
    score: float | None = None  # what it ranks by: the mean of its last validation and its seed retrains'


class Spend(_Row):
    seconds: float
    usd: float
    gpu_hours: float
    setup_seconds: dict[str, float]
    seed_seconds: float = 0.0  # the seed retrains' billed seconds (tune.seeds), beside the trials'


class BestTrial(_Row):
    trial: int
    value: float
    params: TrialParams
    run_key: str | None
    config: str  # where its config is: best_config.yaml, for `retrain run --config`
    evidence: str | None = None  # how it was chosen over the config as given, when they differ
    score: float | None = None  # what it was ranked by (TrialRow.score)
    seeds: int = 1  # the seeds behind that score


class StudyBudget(_Row):
    max_usd: float | None = None
    max_gpu_hours: float | None = None
    max_wall_seconds: float | None = None

    def limits(self) -> dict[str, float]:
        return {k: v for k, v in self.model_dump().items() if v is not None}


class StudyGate(_Row):
    """What the champion/challenger gate decided on the study's answer (tune.promote)."""

    trial: int
    promoted: bool
    reason: str
    report: str  # the answer's run report.json
    base_first: bool = False  # the config as given went through first (the root had no champion)


class TuneReport(_Row):
    study: str
    status: str  # complete, budget_stopped, running
    stop_reason: str | None
    metric: str
    direction: str
    rungs: list[int]
    seeds_skipped: str | None = None  # why tune.seeds' retrains did not run, when they did not
    instance_type: str
    market: str
    rate_per_hour: float
    trials: list[TrialRow]
    spend: Spend
    budget: StudyBudget
    naive: Spend  # every trial trained until its own early stopping, on the study's own market
    saved_fraction: float | None  # of the naive search's machine seconds (so of its cost at any one rate); None: no
    # model, or no trial cut (nothing saved)
    best: BestTrial | None
    gate: StudyGate | None = None  # set once the answer went through the gate

    @classmethod
    def read(cls, path: Path) -> TuneReport:
        return cls.model_validate_json(path.read_bytes())

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def _state(trial: Any, refused: bool) -> str:
    if refused:
        return "refused"
    name = trial.state.name.lower()
    status = trial.user_attrs.get("status")
    if name == "complete":
        return "early_stopped" if status == "early_stopped" else "completed"
    if name == "pruned":
        return "budget" if status in ("budget", "budget_stopped") else "pruned"
    return {"running": "running", "fail": "failed"}.get(name, name)


def _row(study: Study, trial: Any, seeds: dict[tuple[int, int], float | None]) -> TrialRow:
    refused = trial.number in study.gate.refused_trials
    billed = float(trial.user_attrs.get("billed_seconds", 0.0))
    steps = int(trial.user_attrs.get("steps", 0))
    reached = [i for i, step in enumerate(study.rungs) if step <= steps] if steps else []
    value = trial.value if trial.value is not None else (
        trial.intermediate_values[trial.last_step] if trial.last_step is not None else None)
    last = study.ranking_value(trial) if trial.state.name == "COMPLETE" and not refused else None
    seed_values = [v for repeat in range(1, study.seeds + 1) if (v := seeds.get((trial.number, repeat))) is not None]
    runs = [] if last is None else [last, *seed_values]
    return TrialRow(
        number=trial.number, params={} if refused else study.params_of(trial) or {}, state=_state(trial, refused),
        rung=reached[-1] if reached else None, steps=steps, value=value,
        rung_values={int(k): float(v) for k, v in trial.intermediate_values.items()},
        billed_seconds=billed, usd=study.budget.usd(billed), gpu_hours=study.budget.gpu_hours(billed),
        steps_lost=int(trial.user_attrs.get("steps_lost", 0)), preemptions=int(trial.user_attrs.get("preemptions", 0)),
        run_key=trial.user_attrs.get("run_key"), spent_at=trial.user_attrs.get("spent_at"),
        base=study.is_base(trial) and not refused, last_value=last, seed_values=seed_values,
        score=sum(runs) / len(runs) if runs else None,
        finished_at=trial.datetime_complete.isoformat() if trial.datetime_complete is not None else None)


FINISHED = ("completed", "early_stopped")
UNFINISHED = ("pruned", "budget")  # stopped by the schedule or the budget, not by the run itself


def _patience_steps(study: Study) -> int | None:
    """Steps early stopping waits without improvement (train.patience validations of
    train.eval_every steps); None where the study's config left either to auto."""
    train = study.config.train
    if train.eval_every == "auto" or train.patience == "auto" or train.patience == 0:  # 0: early stopping off
        return None
    return train.patience_validations * train.validate_every


def early_stop_step(study: Study, row: TrialRow, median_stop: int | None) -> int:
    """Where a trial the schedule cut would have ended under the run's own early stopping: its
    best rung plus patience when its curve already shows that stop, else the study's median
    stop among finished trials (never before the step it reached, never past train.max_steps)."""
    last = study.config.train.max_steps
    if row.state not in UNFINISHED:
        return row.steps
    patience = _patience_steps(study)
    if patience is not None and row.rung_values:
        # The step early stopping counts from: the last gain beyond train.min_delta.
        sign, delta = (1.0 if study.maximize else -1.0), study.config.train.min_delta
        best_step, best = None, -math.inf
        for step in sorted(row.rung_values):
            if sign * row.rung_values[step] > best + delta:
                best_step, best = step, sign * row.rung_values[step]
        if best_step is not None and best_step + patience <= row.steps:
            return row.steps  # early stopping would have ended it where the schedule did
    stop = median_stop if median_stop is not None else last
    return min(last, max(row.steps, stop))


def _naive(study: Study, rows: list[TrialRow]) -> Spend:
    """The same search without its schedule: every trial run until the run's own early stopping
    ends it (a cut trial where its curve or the study's median stop says it would have), at its
    own measured pace, on the study's own market (like with like: a spot study against an
    on-demand naive search would count the market's discount as the schedule's saving), with the
    same seed retrains (selection costs both searches alike)."""
    cost = study.cost
    rate = study.budget.rate
    stops = sorted(r.steps for r in rows if r.state in FINISHED and r.steps)
    median_stop = stops[len(stops) // 2] if stops else None
    seconds = 0.0
    for row in rows:
        per_step = cost.seconds_per_step
        if row.steps:
            # Its rungs' start-ups are its own extra cost; the naive run pays one.
            rungs = sum(1 for step in study.rungs if step <= row.steps)
            per_step = max(0.0, row.billed_seconds - rungs * cost.startup_seconds) / row.steps or per_step
        seconds += cost.startup_seconds + early_stop_step(study, row, median_stop) * per_step
    setup = study.setup_seconds()
    seeds = sum(record.billed_seconds for record in study.seed_records().values())
    total = seconds + seeds + sum(v for k, v in setup.items() if k != "calibration")
    return Spend(seconds=total, usd=rate * total / SECONDS_PER_HOUR,
                 gpu_hours=study.budget.gpus * total / SECONDS_PER_HOUR, setup_seconds=setup, seed_seconds=seeds)


def _ranked_from(study: Study, finished: list[TrialRow]) -> list[TrialRow]:
    """The trials the answer is picked from, each with the score it ranks by: the seed
    candidates by their mean when every one of them has all of its seed retrains; otherwise
    every finished trial by its own run's last validation alone. A mean over three seeds and a
    single seed are never compared, nor a candidate's partial mean with another's one seed."""
    candidates = {t.number for t in study.seed_candidates()}
    seeded = [r for r in finished if r.number in candidates and len(r.seed_values) == study.seeds]
    if candidates and len(seeded) == len(candidates):
        return seeded
    return [updated(r, {"score": r.last_value, "seed_values": []}) for r in finished]


def build_report(study: Study) -> TuneReport:
    seeds = {key: record.value for key, record in study.seed_records().items()}
    rows = [_row(study, t, seeds) for t in study.trials()]
    spent = study.spent_seconds()
    naive = _naive(study, rows)
    finished = [r for r in rows if r.state in FINISHED and r.score is not None]
    best = None
    if finished:
        sign = 1.0 if study.maximize else -1.0
        pick = max(_ranked_from(study, finished), key=lambda r: (sign * (r.score or 0.0), -r.number))
        assert pick.value is not None  # finished trials have one
        best = BestTrial(trial=pick.number, value=pick.value, params=pick.params, run_key=pick.run_key,
                         config=study.root.display(f"{study.rel}/best_config.yaml"), score=pick.score,
                         seeds=1 + len(pick.seed_values))
    status = "complete" if study.complete() else "budget_stopped" if study.stopped_by else "running"
    t = study.tune
    usd = study.budget.usd(spent)
    return TuneReport(
        study=study.key, status=status, stop_reason=study.stopped_by, metric=study.metric,
        direction="maximize" if study.maximize else "minimize", rungs=study.rungs, seeds_skipped=study.seeds_skipped,
        instance_type=study.config.cost.instance_type, market=study.config.cost.market,
        rate_per_hour=study.budget.rate, trials=rows,
        spend=Spend(seconds=spent, usd=usd, gpu_hours=study.budget.gpu_hours(spent), setup_seconds=study.setup_seconds(),
                    seed_seconds=sum(record.billed_seconds for record in study.seed_records().values())),
        budget=StudyBudget(max_usd=t.max_usd, max_gpu_hours=t.max_gpu_hours, max_wall_seconds=t.max_wall_seconds),
        naive=naive, best=best,
        # A study that produced no model saved nothing: it bought nothing. One that cut no trial
        # ran the naive search itself: it claims no saving either.
        saved_fraction=(1 - spent / naive.seconds) if best is not None and naive.seconds > 0
        and any(r.state in UNFINISHED for r in rows) else None)


def curve_points(report: TuneReport) -> tuple[list[tuple[float, float, str]], list[tuple[float, float]]]:
    """The tune curve's data: each trial's (spend, value, state) at the study's spend when its
    last rung ended (`spent_at`: an ASHA study closes the trials still waiting only at its end,
    which is not when their work was done); and the best full-fidelity value so far at each
    point. A trial recorded before `spent_at` was kept is placed by finish time, at the spend of
    the trials finished up to it."""
    priced = report.rate_per_hour > 0
    running = sum(report.spend.setup_seconds.values())
    placed: list[tuple[float, TrialRow]] = []
    for row in sorted(report.trials, key=lambda r: (r.finished_at is None, r.finished_at or "", r.number)):
        running += row.billed_seconds
        placed.append((row.spent_at if row.spent_at is not None else running, row))
    sign = 1.0 if report.direction == "maximize" else -1.0
    points, best_line, best = [], [], None
    for spent, row in sorted(placed, key=lambda item: (item[0], item[1].number)):
        x = spent * report.rate_per_hour / SECONDS_PER_HOUR if priced else spent
        if row.value is not None:
            points.append((x, row.value, row.state))
        if row.state in ("completed", "early_stopped") and row.value is not None and (
                best is None or sign * row.value > sign * best):
            best = row.value
        if best is not None:
            best_line.append((x, best))
    return points, best_line


def _plot(report: TuneReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=100)
    points, best_line = curve_points(report)
    colors = {"completed": "tab:green", "early_stopped": "tab:green", "pruned": "tab:gray"}
    for label, states in (("full fidelity", ("completed", "early_stopped")), ("pruned", ("pruned",))):
        shown = [(x, v) for x, v, state in points if state in states]
        if shown:
            ax.scatter([x for x, _ in shown], [v for _, v in shown], s=18, color=colors[states[0]], label=label)
    rest = [(x, v) for x, v, state in points if state not in colors]
    if rest:
        ax.scatter([x for x, _ in rest], [v for _, v in rest], s=18, color="tab:orange",
                   label="stopped by the budget, or open")
    if best_line:
        ax.step(*zip(*best_line, strict=True), where="post", color="tab:blue", label="best full-fidelity trial so far")
    if points or best_line:
        # Below the axes: inside them, the legend can hide a trial.
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False, fontsize="small")
    ax.set_xlabel("cumulative cost ($), trials in the order they finished" if report.rate_per_hour > 0
                  else "cumulative machine seconds, trials in the order they finished")
    ax.set_ylabel(f"validation {metric_name(report.metric)}")
    ax.set_title(f"study {report.study}: {len(report.trials)} trials")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _absolute_paths(config: dict[str, Any]) -> dict[str, Any]:
    """The best config's local paths made absolute: `retrain run --config best_config.yaml`
    trains the same data from any folder, not only from the one the study ran in."""
    for section, key in (("data", "source"), ("storage", "root"), ("storage", "local_dir")):
        value = config.get(section, {}).get(key)
        if isinstance(value, str) and value and "://" not in value and not value.startswith("demo:"):
            config[section][key] = str(Path(value).expanduser().resolve())
    return config


# (challenger run key, base run key, confidence) -> PairedDifference JSON
Compare = Callable[[str, str, float], PairedDifference]


def against_base(report: TuneReport, compare: Compare | None, confidence: float = 0.95) -> TuneReport:
    """The study's answer is the config as given (the base trial) unless the best trial beats it
    on the validation split by more than the noise of that split: the paired interval of their
    difference, row by row (DeLong for AUC, a paired bootstrap otherwise), clears zero.

    The best trial is the maximum over the finished trials of scores on those same rows: the
    largest of n noisy differences is optimistic even where no trial is better than the base.
    So the interval is widened for the n it was picked from (Bonferroni: confidence
    1 - (1 - `confidence`) / n), and a pick that clears it would have cleared it had it been the
    only trial. Early stopping also picked each model's step on these rows; it did so for the
    base as well, so that part of the optimism is shared."""
    best = report.best
    finished = [r for r in report.trials if r.state in ("completed", "early_stopped") and r.run_key]
    base = next((r for r in finished if r.base), None)
    if best is None or base is None or best.trial == base.number or compare is None or not (
            best.run_key and base.run_key):
        return report
    picked_from = max(1, sum(1 for r in finished if not r.base))
    widened = 1 - (1 - confidence) / picked_from
    diff = compare(best.run_key, base.run_key, widened)
    ranked = f", ranked by the mean over {best.seeds} seeds" if best.seeds > 1 else ""
    said = (f"validation {diff.metric} {diff.improvement:+.4f} over the config as given "
            f"({diff.confidence:.2%} interval, for the best of {picked_from} trials{ranked}: {diff.low:+.4f} to "
            f"{diff.high:+.4f}, {diff.method}, {diff.rows} rows)")
    if diff.low > 0:
        return updated(report, {"best": updated(best, {"evidence": f"trial {best.trial}: {said}"})})
    assert base.value is not None  # finished trials have one
    kept = BestTrial(trial=base.number, value=base.value, params=base.params, run_key=base.run_key, config=best.config,
                     evidence=f"the config as given: trial {best.trial}'s {said} is within noise", score=base.score,
                     seeds=1 + len(base.seed_values))
    return updated(report, {"best": kept})


def record_gate(root: StorageRoot, report: TuneReport, gate: StudyGate) -> TuneReport:
    """The gate's decision on the answer, written into the study's tune_report.json."""
    gated = updated(report, {"gate": gate})
    rel = f"{study_rel(report.study)}/tune_report.json"
    write_json_atomic(root.path(rel), gated.to_json())
    root.publish(rel, RUN)
    return gated


def write_report(study: Study, compare: Compare | None = None) -> tuple[TuneReport, Path, Path]:
    """Write (and publish) the report, its plot and the best config; (report, json, png).
    `compare` tells the best trial from the config as given (`against_base`)."""
    report = against_base(build_report(study), compare, study.config.eval.confidence)
    folder = study.root.local / study.rel
    rels = []
    if report.best is not None:
        best = _absolute_paths(study.config.with_values(report.best.params, "(tuning trial)").model_dump(
            mode="json", exclude={"tune"}))
        header = (f"# Best trial {report.best.trial} of study {study.key}: validation "
                  f"{metric_name(report.metric)} {report.best.value:.6f}. Run it: retrain run --config <this file>\n")
        write_atomic(folder / "best_config.yaml", (header + yaml.safe_dump(best, sort_keys=False)).encode())
        rels.append(f"{study.rel}/best_config.yaml")
    png = folder / "tune_curve.png"
    _plot(report, png)
    json_path = folder / "tune_report.json"
    write_json_atomic(json_path, report.to_json())
    for rel in [*rels, f"{study.rel}/tune_curve.png", f"{study.rel}/tune_report.json"]:
        study.root.publish(rel, RUN)
    return report, json_path, png
