"""A budgeted, multi-fidelity study: Optuna decides, the pipeline trains, the journal remembers.

A trial is a normal resumable training run (its own run key: the sampled keys are COMPUTED)
trained towards its rungs. At each rung the run pauses with a checkpoint and the study reports
the best validation metric so far to Optuna; going on later resumes the run from that
checkpoint, bit for bit. So a trial stopped at a rung has spent exactly its rungs, and one
promoted to the top is the same run as a plain `retrain run` of its config.

Who goes on (tune.pruner):
- `asha`: ASHA as Li et al. (2020, Algorithm 2) define it. A trial waits at its rung; whenever
  a slot is free, the best waiting trial in the top 1/reduction_factor of every trial that
  reached its rung (highest rung first) is promoted, otherwise a new trial starts. Once no new
  trial can start (max_trials), the best waiting trial of a rung is promotable too, so a small
  study still ends with a full-fidelity trial. Trials still waiting when the study ends are
  closed as pruned at their rung.
- `optuna_sh`: Optuna's SuccessiveHalvingPruner, which decides as a trial reports: it goes on
  at once if it is in the top 1/reduction_factor of its rung so far. The first trials of a rung
  go on unconditionally; `benchmarks/bench_tuning_replay.py` measures what that costs.

Everything that shapes the study's future is in the journal (`training.tune.journal`): the
trials and their parameters, rung values, where each trial was sent (`sent_to`), the
optuna_sh pruner's decisions (Optuna's `completed_rung_*` system attributes plus our `decided`
mark), and each trial's spend. A study killed at any moment and run again:
- resumes trials interrupted on their way to a rung (from their run's checkpoint, never from
  scratch) before anything else; none stays RUNNING, because the study ends only when none is;
- re-applies a decision the kill cut off (both rules are deterministic in the journal: a
  promotion is recorded, as `sent_to`, before its rung is handed out);
- samples new trials with a seed derived from the trial number, so TPE draws what it would
  have drawn uninterrupted;
- carries the spend on: each trial's spend is its run's billed seconds, which count restarts
  and the work a kill lost (the run's heartbeat), exactly as a single run's budget does.
Where the budget binds, what it still pays for (a rung, a new trial beside the leader's reserve)
is priced from rungs measured since the study was opened, so there a resumed study may start a
trial more or fewer than an uninterrupted one would have.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from training.config import RetrainConfig, fingerprint, fingerprinted
from training.cost.bill import SECONDS_PER_HOUR
from training.errors import ConfigError
from training.model.task_metrics import higher_is_better, metric_for
from training.protocol.results import RungResult
from training.search_space import Dimension, TrialParams, parse_space
from training.storage.root import StorageRoot
from training.tune.journal import PublishedJournal
from training.tune.journal_gate import JournalGate
from training.tune.rungs import rungs
from training.copies import updated

__all__ = ["RungCost", "RungWork", "Study", "StudyBudget", "asha_pick", "study_key", "study_rel", "STUDY_DIR"]

log = logging.getLogger(__name__)
STUDY_DIR = "tune"


def study_rel(key: str) -> str:
    """A study's folder under the storage root."""
    return f"{STUDY_DIR}/{key}"


RESERVE_HEADROOM = 1.25  # see Study._leader_reserve
SMALL_DATA_ROWS = 10_000  # tune.seeds auto: below this many training rows, the top trials get more seeds
AUTO_SEEDS = 2
SEED_CANDIDATES = 3  # the config as given and the best others, by their last validation
SEED_RECORD = "seed"  # study attribute "seed:<trial>:<repeat>": one seed retrain's outcome (SeedRecord)


def study_key(config: RetrainConfig, dataset_fingerprint: str) -> str:
    """What defines a study: the data, everything a trial computes besides its sampled keys,
    the metric, and the search (space, sampler, pruner, rungs, seed). Budgets, max_trials and
    concurrency are not part of it: raising them continues the same study."""
    # An earlier "asha" decided like optuna_sh: its studies get a new key rather than continuing
    # under another rule.
    rule = {"promotion": "deferred"} if config.tune.pruner == "asha" else {}
    return fingerprint("tune", dataset_fingerprint, fingerprinted(config), {"eval.metric": config.eval.metric},
                       fingerprinted(config.tune), rule)


def asha_pick(reached: Sequence[Sequence[tuple[float, int]]], waiting: Callable[[int, int], bool],
              reduction_factor: int, can_start: bool) -> tuple[int, int] | None:
    """Li et al.'s ASHA promotion (2020, Algorithm 2). `reached[k]` holds (score, trial) for
    every trial that reached rung k (the rungs below the top; lower scores rank first). From
    the highest rung down, the first trial in the top len // reduction_factor of its rung (at
    least the best one once no new trial can start) that is `waiting(trial, k)` there: that
    (trial, k) goes on; None: start a new trial. The replay benchmark decides with it too."""
    for k in range(len(reached) - 1, -1, -1):
        ranked = sorted(reached[k])
        for _, trial in ranked[:len(ranked) // reduction_factor or (0 if can_start else 1)]:
            if waiting(trial, k):
                return trial, k
    return None


@dataclass(frozen=True)
class RungCost:
    """The price model of a rung, in machine seconds: one process start plus its steps."""

    startup_seconds: float
    seconds_per_step: float

    def of(self, steps: int) -> float:
        return self.startup_seconds + steps * self.seconds_per_step


class StudyBudget:
    """tune.max_usd, max_gpu_hours and max_wall_seconds as one limit in machine seconds (each
    is rate x seconds, as a single run's budget counts them)."""

    def __init__(self, config: RetrainConfig) -> None:
        t = config.tune
        self.rate, self.gpus = config.cost.rate()
        limits = [("tune.max_wall_seconds", t.max_wall_seconds, 1.0),
                  ("tune.max_usd", t.max_usd, self.rate / SECONDS_PER_HOUR),
                  ("tune.max_gpu_hours", t.max_gpu_hours, self.gpus / SECONDS_PER_HOUR)]
        self.limits = [(key, limit, per_s) for key, limit, per_s in limits if limit is not None and per_s > 0]
        self.unpriced = [key for key, limit, per_s in limits if limit is not None and per_s == 0]

    def seconds(self) -> float:
        """The tightest limit in machine seconds (infinite without one)."""
        return min((limit / per_s for _, limit, per_s in self.limits), default=math.inf)

    def binding(self) -> str:
        key, limit, _ = min(self.limits, key=lambda item: item[1] / item[2])
        return f"{key}={limit:g}"

    def usd(self, seconds: float) -> float:
        return seconds * self.rate / SECONDS_PER_HOUR

    def gpu_hours(self, seconds: float) -> float:
        return seconds * self.gpus / SECONDS_PER_HOUR


@dataclass(frozen=True)
class _Observed:
    """A rung trained this attempt: its steps, their machine seconds, and its start-up."""

    steps: int
    seconds: float
    startup: float


@dataclass(frozen=True)
class RungWork:
    """Train trial `trial`'s run towards `step` (rung `rung`); `config` is the trial's, with
    its run capped (budget.max_wall_seconds, operational) so the study cannot overshoot.
    `repeat` > 0: the trial's config retrained to the end with train.seed + repeat."""

    trial: int
    params: TrialParams
    config: RetrainConfig
    step: int
    rung: int
    price_seconds: float  # the estimate this work was admitted on
    repeat: int = 0

    @property
    def label(self) -> str:
        return f"{self.trial}" if not self.repeat else f"{self.trial}-seed-{self.repeat}"


@dataclass(frozen=True)
class SeedRecord:
    """A seed retrain's outcome, as the study keeps it: its run, its billed seconds, and its last
    validation (None: its run was stopped before the end, so it ranks nothing)."""

    run_key: str
    billed_seconds: float
    value: float | None

    def to_json(self) -> dict[str, Any]:
        return {"run_key": self.run_key, "billed_seconds": self.billed_seconds, "value": self.value}


def seed_attr(trial: int, repeat: int) -> str:
    return f"{SEED_RECORD}:{trial}:{repeat}"


class Study:
    def __init__(self, config: RetrainConfig, dataset_fingerprint: str, cost: RungCost,
                 given: RetrainConfig | None = None, train_rows: int | None = None) -> None:
        """`config` has train.eval_every and train.patience resolved for the data (the rungs are
        validated steps); `given` is the config as the user gave it, which trials train from: a
        trial whose values are the given config's is that config's `retrain run`, the same run
        key, so an identical finished run is found rather than trained again (the trainer
        resolves `auto` the same way for the same data). `train_rows` resolves tune.seeds auto."""
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.config, self.tune, self.cost = config, config.tune, cost
        self.given = given or config
        self.rungs = rungs(config)
        self.dims: list[Dimension] = parse_space(config.tune.space)
        self.key = study_key(config, dataset_fingerprint)
        self.rel = study_rel(self.key)
        self.root = StorageRoot.from_config(config)
        self.metric = metric_for(config.data.task, config.eval.metric)
        self.maximize = higher_is_better(config.data.task, self.metric)
        self.deferred = self.tune.pruner == "asha"  # promotions decided here, not by an Optuna pruner
        pruner = (optuna.pruners.SuccessiveHalvingPruner(min_resource=self.rungs[0], min_early_stopping_rate=0,
                                                         reduction_factor=self.tune.reduction_factor)
                  if self.tune.pruner == "optuna_sh" else optuna.pruners.NopPruner())
        journal = f"{self.rel}/journal.log"
        self.gate = JournalGate(self.root.display(journal), self.key, self.dims, self.rungs)
        storage = optuna.storages.JournalStorage(PublishedJournal(self.root, journal, self.gate))
        self.study = optuna.create_study(study_name=self.key, storage=storage, pruner=pruner, load_if_exists=True,
                                         direction="maximize" if self.maximize else "minimize")
        self.budget = StudyBudget(config)
        self.in_flight: dict[int, float] = {}  # trial number -> the seconds reserved for its rung
        self.stopped_by: str | None = None  # why no more work was handed out, when it was a budget
        self._observed: list[_Observed] = []  # the rungs trained this attempt
        seeds = self.tune.seeds
        self.seeds = seeds if isinstance(seeds, int) else (
            AUTO_SEEDS if train_rows is not None and train_rows < SMALL_DATA_ROWS else 0)
        self.seeding: dict[tuple[int, int], float] = {}  # (trial, repeat) in flight -> its reserved seconds
        self.seeds_skipped: str | None = None  # why the seed retrains did not run, when they did not

    # -- spend ----------------------------------------------------------------------------

    def add_setup_seconds(self, seconds: float, what: str) -> None:
        """Machine time the study spent outside its trials (pack, preprocess, calibration)."""
        attrs = self.study.user_attrs
        self.study.set_user_attr(f"{what}_seconds", float(attrs.get(f"{what}_seconds", 0.0)) + seconds)

    def setup_seconds(self) -> dict[str, float]:
        return {k.removesuffix("_seconds"): float(v) for k, v in self.study.user_attrs.items() if k.endswith("_seconds")}

    def trial_seconds(self) -> float:
        """Every trial run's billed seconds, once per run (two trials that drew the same
        parameters share one run, trained once)."""
        per_run: dict[str, float] = {}
        for trial in self.study.get_trials(deepcopy=False):
            run, billed = trial.user_attrs.get("run_key"), trial.user_attrs.get("billed_seconds")
            if run is not None and billed is not None:
                per_run[run] = max(per_run.get(run, 0.0), float(billed))
        for record in self.seed_records().values():
            per_run[record.run_key] = max(per_run.get(record.run_key, 0.0), record.billed_seconds)
        return sum(per_run.values())

    def spent_seconds(self) -> float:
        return sum(self.setup_seconds().values()) + self.trial_seconds()

    def remaining_seconds(self) -> float:
        return (self.budget.seconds() - self.spent_seconds() - sum(self.in_flight.values())
                - sum(self.seeding.values()))

    def check_first_rung(self) -> None:
        """Refuse a budget that cannot pay for one rung, before any trial starts."""
        price = self.cost.of(self.rungs[0])
        left = self.budget.seconds() - self.spent_seconds()
        if price > left and not self.study.get_trials(deepcopy=False):
            b = self.budget
            raise ConfigError(
                f"{b.binding()} cannot pay for the first rung: {self.rungs[0]} steps priced at "
                f"${b.usd(price):.6f}, {price:.1f} machine-s ({self.cost.seconds_per_step * 1000:.2f} ms/step + "
                f"{self.cost.startup_seconds:.1f} s start-up, measured by the calibration; "
                f"${b.usd(self.spent_seconds()):.6f} spent on set-up and calibration). No trial was started; raise "
                "the budget or lower tune.min_resource")

    # -- handing out work -------------------------------------------------------------------

    def trials(self, *states: Any) -> list[Any]:
        return sorted(self.study.get_trials(deepcopy=False, states=states or None), key=lambda t: t.number)

    def next_work(self) -> RungWork | None:
        """The next rung to train: an interrupted trial's (oldest first), else (asha) a
        promotion, else a new trial's first rung; None when there is none the budget and
        max_trials allow (asha then closes the trials still waiting)."""
        from optuna.trial import TrialState

        for frozen in self.trials(TrialState.RUNNING):
            if frozen.number in self.in_flight:
                continue
            work = self._continue(frozen)
            if work is not None:
                return work
        if self.deferred and self.stopped_by is None:
            work = self._promotion()
            if work is not None:
                return work
        if self._seeds_begun():  # a new trial now could displace a candidate half retrained
            return self._seed_work()
        work = self._new_trial()
        if work is None and self.deferred and not self.in_flight:
            self._close_waiting()
        if work is None and not self.in_flight and not self.trials(TrialState.RUNNING):
            work = self._seed_work()
        return work

    def _new_trial(self) -> RungWork | None:
        if not self._can_start() or self.stopped_by is not None:
            return None
        price = self.price(self.rungs[0])
        if price > self.remaining_seconds():
            self.stopped_by = f"{self.budget.binding()}: the next trial's first rung would not be paid for"
            return None
        self._reseed()
        if not self.study.get_trials(deepcopy=False):
            self._enqueue_base()
        trial = self.study.ask({d.key: d.distribution() for d in self.dims})
        params = {d.key: d.value(trial.params[d.key]) for d in self.dims}
        trial.set_user_attr("params", json.dumps(params, sort_keys=True))
        return self._work(trial.number, params, 0, price)

    def _enqueue_base(self) -> None:
        """The study's first trial is the config as given, when the space holds each of its
        values: a study that can pay for that trial to finish never ends worse, on validation,
        than the run it tunes."""
        params = {d.key: d.param_of(self.config.value_at(d.key)) for d in self.dims}
        if all(value is not None for value in params.values()):
            self.study.enqueue_trial(params)

    def _can_start(self) -> bool:
        """A new trial may start: max_trials allows it, and the budget left after its first rung
        still pays for the leading trial to reach full fidelity. Without that reserve a study
        capped by a budget spends it all on first rungs: ASHA promotes from a rung only once
        reduction_factor trials reached it, and a study ended by its budget has only pruned
        trials, none trained to the end."""
        if len(self.study.get_trials(deepcopy=False)) >= self.tune.max_trials:
            return False
        reserve = self._leader_reserve() + self._seed_reserve()
        if reserve == 0.0:
            return True
        # The new trial's first rung priced as the dearest trial so far would price it: its
        # sampled widths are unknown until it runs, and a cheap estimate here would leave the
        # leader short after an expensive first rung.
        first = max([self.price(self.rungs[0])] + [self.price(self.rungs[0], t) for t in self.study.get_trials(
            deepcopy=False) if t.user_attrs.get("steps")])
        return self.remaining_seconds() - first >= reserve

    def _leader_reserve(self) -> float:
        """The price of taking the trial ASHA would promote once no new trial can start on from
        its rung to train.max_steps (0 with no such trial, without a budget, or outside asha)."""
        if not self.deferred or not math.isfinite(self.budget.seconds()):
            return 0.0
        trials, pick = self._asha_pick(can_start=False)
        if pick is None:
            return 0.0
        # Headroom: a rung's seconds vary with the machine's load by about this much, and a
        # leader stopped by the budget a few steps short of the end is the loss this guards.
        return RESERVE_HEADROOM * self.price(self.rungs[-1] - self.rungs[pick[1]], trials[pick[0]])

    def _continue(self, frozen: Any) -> RungWork | None:
        """A RUNNING trial's next rung when it has one to train now: interrupted on its way to
        a rung, or (optuna_sh) promoted by the pruner."""
        last = frozen.last_step
        if self.deferred:
            if int(frozen.user_attrs.get("sent_to", self.rungs[0])) <= (last or 0):
                return None  # waiting at its rung for a promotion (_promotion)
        elif last is not None and frozen.user_attrs.get("decided") != last and self._pruned(frozen.number, last):
            return None
        if last is not None and last >= self.rungs[-1]:  # its end was reported, its completion cut off
            self.study.tell(frozen.number, frozen.intermediate_values[last])
            return None
        return self._go_on(frozen, 0 if last is None else next(i for i, step in enumerate(self.rungs) if step > last))

    def _go_on(self, frozen: Any, rung: int) -> RungWork | None:
        """The trial's work towards `rung`, if the budget pays for it. If not, the study stops
        (cheaper work, a new trial or a lower rung, could not reach full fidelity either) and the
        trial ends where it stands, like a pruned one: its last rung value stays known to the
        sampler, and it never waits RUNNING for a budget that may not come."""
        from optuna.trial import TrialState

        price = self.price(self.rungs[rung] - (frozen.last_step or 0), frozen)
        if price > self.remaining_seconds():
            self.stopped_by = f"{self.budget.binding()}: trial {frozen.number}'s next rung would not be paid for"
            self._live(frozen.number).set_user_attr("status", "budget")
            self.study.tell(frozen.number, state=TrialState.PRUNED)
            return None
        params = self.params_of(frozen)
        if params is None:  # killed between Optuna's ask and the sampling: nothing to train
            self._live(frozen.number).set_user_attr("status", "pruned")
            self.study.tell(frozen.number, state=TrialState.FAIL)
            return None
        return self._work(frozen.number, params, rung, price)

    def params_of(self, frozen: Any) -> TrialParams | None:
        """The config values a trial trains with (each checked against tune.space by the journal's
        gate), or None for a trial that has none."""
        raw = frozen.user_attrs.get("params")
        if raw is not None:
            params: TrialParams = json.loads(raw)
            return params
        if set(frozen.params) == {d.key for d in self.dims}:
            return {d.key: d.value(frozen.params[d.key]) for d in self.dims}
        return None

    def _work(self, number: int, params: TrialParams, rung: int, price: float) -> RungWork:
        trial = self.study.get_trials(deepcopy=False)[number]
        config = self._capped(self.given.with_values(params, f"(tuning trial {params})"),
                              float(trial.user_attrs.get("billed_seconds", 0.0)))
        self.in_flight[number] = price
        if trial.user_attrs.get("sent_to") != self.rungs[rung]:
            self._live(number).set_user_attr("sent_to", self.rungs[rung])  # journaled before it trains
        return RungWork(trial=number, params=params, config=config, step=self.rungs[rung], rung=rung,
                        price_seconds=price)

    def _promotion(self) -> RungWork | None:
        """The base (the config as given) goes on first, whenever it waits: it is never pruned,
        so the study always holds the run it must beat. Then ASHA's promotion (`asha_pick`),
        unless taking another trial up would spend what the leading trial needs to finish (then
        the leader goes on instead)."""
        base = self._waiting_base()
        if base is not None:
            return self._go_on(base, next(i for i, step in enumerate(self.rungs) if step > base.last_step))
        trials, pick = self._asha_pick(self._can_start())
        if pick is None:
            return None
        reserve = self._leader_reserve() + self._seed_reserve()
        if reserve > 0:
            _, leader = self._asha_pick(can_start=False)
            price = self.price(self.rungs[pick[1] + 1] - self.rungs[pick[1]], trials[pick[0]])
            if leader is not None and leader != pick and self.remaining_seconds() - price < reserve:
                pick = leader
        if self.seed_candidates():
            # Trials to retrain exist: selection is paid first, so no promotion, the leader's
            # included, spends what their seed retrains need (an unpaid one skips them all).
            price = self.price(self.rungs[pick[1] + 1] - self.rungs[pick[1]], trials[pick[0]])
            if self.remaining_seconds() - price < self._seed_reserve():
                return None
        return self._go_on(trials[pick[0]], pick[1] + 1)

    def _capped(self, config: RetrainConfig, spent: float) -> RetrainConfig:
        """The run capped at what the study has left (budget.max_wall_seconds counts the run's
        billed seconds, `spent` of them already), so the study cannot overshoot."""
        cap = spent + self.remaining_seconds()
        if not math.isfinite(cap):
            return config
        own = config.budget.max_wall_seconds
        budget = updated(config.budget, {"max_wall_seconds": cap if own is None else min(own, cap)})
        return updated(config, {"budget": budget})

    @staticmethod
    def is_base(frozen: Any) -> bool:
        """The study's first trial, enqueued with the config's own values (`_enqueue_base`)."""
        return bool(frozen.number == 0 and "fixed_params" in frozen.system_attrs)

    def _waiting_base(self) -> Any | None:
        from optuna.trial import TrialState

        trials = self.study.get_trials(deepcopy=False)
        base = trials[0] if trials else None
        if base is None or not self.is_base(base) or base.state != TrialState.RUNNING or 0 in self.in_flight:
            return None
        step = base.last_step
        waiting = step is not None and step < self.rungs[-1] and int(base.user_attrs.get("sent_to", step)) == step
        return base if waiting else None

    def _asha_pick(self, can_start: bool) -> tuple[dict[int, Any], tuple[int, int] | None]:
        """The journal's trials by number, and the (trial, rung) `asha_pick` promotes."""
        from optuna.trial import TrialState

        trials = {t.number: t for t in self.study.get_trials(deepcopy=False)}
        sign = -1.0 if self.maximize else 1.0
        reached = [[(sign * t.intermediate_values[step], t.number) for t in trials.values()
                    if step in t.intermediate_values] for step in self.rungs[:-1]]

        def waiting(number: int, rung: int) -> bool:
            frozen, step = trials[number], self.rungs[rung]
            return (frozen.state == TrialState.RUNNING and number not in self.in_flight and frozen.last_step == step
                    and int(frozen.user_attrs.get("sent_to", step)) == step)

        return trials, asha_pick(reached, waiting, self.tune.reduction_factor, can_start)

    def _close_waiting(self) -> None:
        """The study hands out nothing more: trials still waiting at a rung end there, pruned
        (never left RUNNING)."""
        from optuna.trial import TrialState

        for frozen in self.trials(TrialState.RUNNING):
            self._live(frozen.number).set_user_attr("status", "pruned")
            self.study.tell(frozen.number, state=TrialState.PRUNED)

    def price(self, steps: int, trial: Any = None) -> float:
        """A rung's estimated machine seconds: measured on this attempt's rungs when any ran,
        else from the calibration. Most rungs start in a warm child (about 0.01 s, see
        training.launch.child) rather than a fresh one (the calibration's start-up), so the start-up
        is the mean of those measured too. A trial that trained already is priced at its own
        seconds per step where they are higher: sampled widths make one trial's step cost a
        multiple of another's."""
        observed = self._observed
        if not observed:
            return self.cost.of(steps)
        n = sum(o.steps for o in observed)
        per_step = sum(o.seconds for o in observed) / n
        per_step = per_step if per_step > 0 else self.cost.seconds_per_step  # start-ups vary more than short rungs last
        if trial is not None and trial.user_attrs.get("steps"):
            attrs = trial.user_attrs
            own = (float(attrs.get("billed_seconds", 0.0)) - float(attrs.get("startup_seconds", 0.0))) / attrs["steps"]
            per_step = max(per_step, own)
        return sum(o.startup for o in observed) / len(observed) + steps * per_step

    def _reseed(self) -> None:
        """A sampler seeded by the trial number: a resumed study draws what it would have drawn."""
        import optuna

        # Hashed, not seed + n: neighbouring seeds of numpy's generator draw alike at first.
        number = len(self.study.get_trials(deepcopy=False))
        seed = int.from_bytes(hashlib.sha256(f"{self.tune.seed}:{number}".encode()).digest()[:4], "little")
        self.study.sampler = (optuna.samplers.RandomSampler(seed=seed) if self.tune.sampler == "random"
                              else optuna.samplers.TPESampler(seed=seed))

    # -- seeds ------------------------------------------------------------------------------
    # On a small table one validation split is noisy: the best of n trials on it is often a lucky
    # seed. Once the trials are done, the candidates (the config as given and the best others)
    # are retrained with other seeds, and the answer is the best mean (study_report).

    def seed_records(self) -> dict[tuple[int, int], SeedRecord]:
        """The seed retrains done: (trial, repeat) -> outcome (each line checked by the gate)."""
        found = {}
        for key, value in self.study.user_attrs.items():
            kind, _, rest = key.partition(":")
            if kind == SEED_RECORD and isinstance(value, dict):
                trial, _, repeat = rest.partition(":")
                found[(int(trial), int(repeat))] = SeedRecord(
                    str(value["run_key"]), float(value["billed_seconds"]),
                    None if value["value"] is None else float(value["value"]))
        return found

    @staticmethod
    def ranking_value(frozen: Any) -> float | None:
        """What a finished trial ranks by: its run's last validation. Its best validation is a
        maximum early stopping took over the very rows the ranking reads. (A trial finished
        before the last one was kept: its best.)"""
        last = frozen.user_attrs.get("last_value")
        return float(last) if last is not None else frozen.value

    def seed_candidates(self) -> list[Any]:
        """The trials retrained with more seeds: the config as given, then the best others by
        `ranking_value`, SEED_CANDIDATES in all; none with fewer than two finished trials."""
        from optuna.trial import TrialState

        sign = -1.0 if self.maximize else 1.0
        finished = [(not self.is_base(t), sign * value, t.number, t) for t in self.trials(TrialState.COMPLETE)
                    if (value := self.ranking_value(t)) is not None]
        ranked = [t for *_, t in sorted(finished, key=lambda item: item[:3])]
        return ranked[:SEED_CANDIDATES] if self.seeds and len(ranked) >= 2 else []

    def _seed_retrains(self, candidates: list[Any] | None = None) -> list[tuple[Any, int]]:
        """Every (candidate trial, repeat) the seed phase trains, in the order it trains them."""
        chosen = self.seed_candidates() if candidates is None else candidates
        return [(t, repeat) for t in chosen for repeat in range(1, self.seeds + 1)]

    def _seed_price(self, frozen: Any) -> float:
        """A seed retrain priced as its trial's run to the step it ended at, with the headroom
        of a rung's variation under load."""
        return RESERVE_HEADROOM * self.price(int(frozen.user_attrs.get("steps") or self.rungs[-1]), frozen)

    def _seed_reserve(self) -> float:
        """What the seed retrains still to come will cost, kept back from new trials and
        promotions once there are trials to retrain: each retrain priced as the dearest
        finished trial. A budget that cannot keep that much back skips them at once, so the
        trials have all of it."""
        from optuna.trial import TrialState

        if not self.seeds or self.seeds_skipped is not None or not math.isfinite(self.budget.seconds()):
            return 0.0
        candidates = self.seed_candidates()
        if not candidates:
            return self._seed_reserve_ahead()
        done = self.seed_records()
        have = sum(1 for t, repeat in self._seed_retrains(candidates) if (t.number, repeat) in done)
        # At least one candidate's worth: the trial this reserve lets start may become one.
        left = max(self.seeds, SEED_CANDIDATES * self.seeds - have)
        reserve = left * max(self._seed_price(t) for t in self.trials(TrialState.COMPLETE))
        if reserve > self.remaining_seconds() and have < len(candidates) * self.seeds:
            self._skip_seeds(left, reserve)
            return 0.0
        # The candidates retrained, a reserve beyond the budget stops new trials: one that became
        # a candidate could not be retrained, and would leave the seeds' ranking incomplete.
        return reserve

    def _seed_reserve_ahead(self) -> float:
        """Before two trials finished (under ASHA, late: its promotions come last): once the
        first SEED_CANDIDATES trials have started, the seed retrains are kept back from the
        trials beyond them, each priced as a full run, so selection is paid before the search
        widens; otherwise the wider search spends what ranking its answer needs. A budget that
        cannot keep that much back skips them then, so the trials have all of it."""
        if len(self.study.get_trials(deepcopy=False)) < SEED_CANDIDATES:
            return 0.0  # the retrains need trials to retrain first
        full = self.rungs[-1]
        price = RESERVE_HEADROOM * max([self.price(full)] + [self.price(full, t) for t in self.study.get_trials(
            deepcopy=False) if t.user_attrs.get("steps")])
        retrains = SEED_CANDIDATES * self.seeds
        reserve = retrains * price
        if reserve > self.remaining_seconds():
            self._skip_seeds(retrains, reserve)
            return 0.0
        return reserve

    def _skip_seeds(self, retrains: int, price: float) -> None:
        left = self.remaining_seconds()
        self.seeds_skipped = (f"{self.budget.binding()} leaves ${self.budget.usd(left):.6f} ({left:.1f} machine-s) "
                              f"for {retrains} seed retrains priced at {price:.1f} machine-s; the answer is ranked "
                              "on one seed")

    def _seeds_begun(self) -> bool:
        """Some of the candidates' seed retrains are done or in flight, and some are not."""
        if self.seeding:
            return True
        if self.seeds_skipped is not None:
            return False
        done = self.seed_records()
        wanted = [(t.number, repeat) for t, repeat in self._seed_retrains()]
        return any(key in done for key in wanted) and not all(key in done for key in wanted)

    def _seed_work(self) -> RungWork | None:
        """The next seed retrain, once no trial is left to train; all of them or none: a mean
        over some candidates' seeds and not others' would compare unlike things."""
        if self.seeds_skipped is not None:
            return None
        done = self.seed_records()
        todo = [(t, repeat) for t, repeat in self._seed_retrains()
                if (t.number, repeat) not in done and (t.number, repeat) not in self.seeding]
        if not todo:
            return None
        prices = [self._seed_price(t) for t, _ in todo]
        if sum(prices) > self.remaining_seconds():
            self._skip_seeds(len(todo), sum(prices))
            return None
        frozen, repeat = todo[0]
        params = self.params_of(frozen)
        assert params is not None  # a finished trial trained with its parameters
        trial_config = self.given.with_values(params, f"(tuning trial {params})")
        config = self._capped(trial_config.with_values({"train.seed": trial_config.train.seed + repeat},
                                                       f"(tuning trial {params}, seed retrain {repeat})"), 0.0)
        self.seeding[(frozen.number, repeat)] = prices[0]
        return RungWork(trial=frozen.number, params=params, config=config, step=self.rungs[-1],
                        rung=len(self.rungs) - 1, price_seconds=prices[0], repeat=repeat)

    def _record_seed(self, work: RungWork, outcome: RungResult) -> None:
        self.seeding.pop((work.trial, work.repeat), None)
        finished = outcome.status in ("completed", "early_stopped")
        value = (outcome.last_value if outcome.last_value is not None else outcome.value) if finished else None
        self.study.set_user_attr(seed_attr(work.trial, work.repeat),
                                 SeedRecord(outcome.run_key, outcome.billed_seconds, value).to_json())

    # -- results ----------------------------------------------------------------------------

    def record(self, work: RungWork, outcome: RungResult) -> None:
        """A rung's outcome: its spend, its value, and the pruner's decision."""
        from optuna.trial import TrialState

        if work.repeat:
            self._record_seed(work, outcome)
            return
        self.in_flight.pop(work.trial, None)
        trial = self.study.get_trials(deepcopy=False)[work.trial]
        billed, step = float(trial.user_attrs.get("billed_seconds", 0.0)), trial.last_step or 0
        started = max(0.0, outcome.startup_seconds - float(trial.user_attrs.get("startup_seconds", 0.0)))
        if outcome.step > step and outcome.billed_seconds > billed:
            self._observed.append(_Observed(outcome.step - step, outcome.billed_seconds - billed - started, started))
        live = self._live(work.trial)
        for key, value in (("run_key", outcome.run_key), ("billed_seconds", outcome.billed_seconds),
                           ("startup_seconds", outcome.startup_seconds),
                           ("steps", outcome.step), ("steps_lost", outcome.steps_lost),
                           ("preemptions", outcome.preemptions), ("status", outcome.status)):
            live.set_user_attr(key, value)
        live.set_user_attr("spent_at", self.spent_seconds())  # where the curve plots it
        if outcome.status in ("paused", "budget_stopped") and outcome.step not in trial.intermediate_values \
                and math.isfinite(outcome.value):
            live.report(outcome.value, outcome.step)  # a budget stop's score is known too
        if outcome.status == "paused":
            if not self.deferred:
                self._pruned(work.trial, outcome.step)
        elif outcome.status == "budget_stopped":
            self.study.tell(work.trial, state=TrialState.PRUNED)
        else:  # completed or early_stopped: the run is finished, at full fidelity for its schedule
            if outcome.last_value is not None and math.isfinite(outcome.last_value):
                live.set_user_attr("last_value", outcome.last_value)
            self.study.tell(work.trial, outcome.value)

    def _pruned(self, number: int, step: int) -> bool:
        """Ask the pruner about the trial's value at `step`; tell it PRUNED if so. Marked
        decided afterwards, so a decision a kill cut off is made again, the same way."""
        from optuna.trial import TrialState

        trial = self._live(number)
        prune = not self.is_base(self.study.get_trials(deepcopy=False)[number]) and trial.should_prune()
        if prune:
            trial.set_user_attr("status", "pruned")
            self.study.tell(number, state=TrialState.PRUNED)
        else:
            trial.set_user_attr("decided", step)
        return prune

    def _live(self, number: int) -> Any:
        """The trial as Optuna's `Trial` (report, user attributes, should_prune), whichever
        process created it."""
        import optuna

        return optuna.trial.Trial(self.study, self.study.get_trials(deepcopy=False)[number]._trial_id)

    def complete(self) -> bool:
        """Every trial of max_trials is finished."""
        from optuna.trial import TrialState

        trials = self.study.get_trials(deepcopy=False)
        return len(trials) >= self.tune.max_trials and all(t.state != TrialState.RUNNING for t in trials)
