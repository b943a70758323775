"""What a line of a study's journal may say.

The journal lives under the storage root, so it is input from whoever can write the root. Every
line passes this gate before Optuna replays it (`training.tune.journal`), so neither Optuna's
sampler nor the study ever sees a parameter outside `tune.space`, an attribute the study does not
write, or a value of the wrong type:

- a trial's parameters are the space's keys, each inside its distribution, and the `params`
  attribute the study trains from agrees with them;
- a trial's attributes are the study's own keys (`TRIAL_ATTRS`), each of its type and range;
- the study's attributes are its set-up spend, finite and not negative, and its seed retrains'
  outcomes (`seed:<trial>:<repeat>`: a trial the journal created, a repeat tune.seeds allows, a
  run key, billed seconds and a finite score or none).

A line that breaks a rule about a trial refuses that trial: it is replayed as failed (never
trained, never the best) and a warning names the journal, the line and the key. A rule about the
study itself (a second study, a deletion, an unknown study attribute) turns the line into one that
changes nothing. A line that is not a journal record at all is damage: one `DataError` naming the
line, with how to recover.

Each line is replaced one for one, so Optuna's log numbers (its read offsets) stay the lines'.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

from training.config import MAX_TUNE_SEEDS
from training.errors import DataError
from training.search_space import Dimension

__all__ = ["JournalGate", "Refusal", "TRIAL_ATTRS", "REFUSED_WORKER"]

log = logging.getLogger(__name__)

REFUSED_WORKER = "retrain-journal-gate"  # the worker id of the lines the gate puts in place of refused ones

# Optuna's journal operations (optuna.storages.journal._storage.JournalOperation) and trial states.
CREATE_STUDY, DELETE_STUDY, SET_STUDY_USER_ATTR, SET_STUDY_SYSTEM_ATTR = 0, 1, 2, 3
CREATE_TRIAL, SET_TRIAL_PARAM, SET_TRIAL_STATE_VALUES, SET_TRIAL_INTERMEDIATE_VALUE = 4, 5, 6, 7
SET_TRIAL_USER_ATTR, SET_TRIAL_SYSTEM_ATTR, DISCARD_TRIALS = 8, 9, 10
RUNNING, COMPLETE, PRUNED, FAIL, WAITING = 0, 1, 2, 3, 4
_FINISHED = {COMPLETE, PRUNED, FAIL}

STUDY_ATTRS = frozenset({"setup_seconds", "calibration_seconds"})
STATUSES = frozenset({"paused", "completed", "early_stopped", "budget_stopped", "budget", "pruned"})
_RUN_KEY = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


class _Refused(ValueError):
    """A line breaks a rule; the message names the key."""


# The real ranges of what a study records: a study is bounded by its budget, and no budget buys
# ten years of machine time or a trillion steps. Finite is not a range: 1e300 seconds is finite.
MAX_SECONDS = 10 * 366 * 86_400.0
MAX_COUNT = 10**12


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
        raise _Refused(f"must be a whole number from 0 to {MAX_COUNT:.0e}, not {value!r}")
    return value


def _seconds(value: Any) -> float:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not 0 <= value <= MAX_SECONDS):
        raise _Refused(f"must be a number of seconds from 0 to {MAX_SECONDS:.0f} (ten years), not {value!r}")
    return float(value)


def _score(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _Refused(f"must be a finite number, not {value!r}")
    return float(value)


def _status(value: Any) -> str:
    if value not in STATUSES:
        raise _Refused(f"must be one of {sorted(STATUSES)}, not {value!r}")
    return str(value)


def _run_key(value: Any) -> str:
    if not isinstance(value, str) or not _RUN_KEY.match(value):
        raise _Refused(f"must be a run key (letters, digits, '_', '.', '-'), not {value!r}")
    return value


TRIAL_ATTRS: dict[str, Callable[[Any], Any]] = {
    "run_key": _run_key, "billed_seconds": _seconds, "startup_seconds": _seconds, "steps": _count,
    "steps_lost": _count, "preemptions": _count, "status": _status, "decided": _count, "spent_at": _seconds,
    "last_value": _score,
    # "sent_to" and "params" depend on the study: see JournalGate._user_attr.
}


@dataclass
class _Trial:
    state: int
    params: dict[str, None | bool | int | float | str] = field(default_factory=dict)  # key -> Optuna's external value


@dataclass(frozen=True)
class Refusal:
    line: int
    trial: int | None  # None: a line about the study
    why: str


class JournalGate:
    """Checks the lines of one study's journal, in order, against its space and rungs."""

    def __init__(self, where: str, study_name: str, dims: list[Dimension], rungs: list[int]) -> None:
        self.where, self.study_name = where, study_name
        self.dims = {d.key: d for d in dims}
        self._distributions = {d.key: d.distribution() for d in dims}
        self.rungs = set(rungs)
        self.study_id: int | None = None  # 0 once created: the only study the gate lets Optuna create
        self._trials: dict[int, _Trial] = {}  # trial id -> what the gate let through
        self._next_trial_id = 0
        self._admitted: list[dict[str, Any]] = []  # by log number: what Optuna was given
        self.refusals: list[Refusal] = []

    @property
    def refused_trials(self) -> dict[int, str]:
        """Trial id (the study's trial number: it is the only study) -> why it was refused."""
        return {r.trial: r.why for r in self.refusals if r.trial is not None}

    def admit(self, number: int, line: bytes) -> dict[str, Any]:
        """Log `number` (0-based; line number + 1) as Optuna may replay it."""
        if number < len(self._admitted):  # read again from an earlier offset: the same answer
            return self._admitted[number]
        assert number == len(self._admitted), "journal lines are admitted in order"
        try:
            record = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            raise self._damage(number, "is not a JSON record") from None
        if not isinstance(record, dict) or not isinstance(record.get("op_code"), int) \
                or isinstance(record.get("op_code"), bool) or not isinstance(record.get("worker_id"), str):
            raise self._damage(number, "is not an Optuna journal record (no op_code and worker_id)")
        admitted = self._admit(number, record)
        self._admitted.append(admitted)
        return admitted

    def _damage(self, number: int, what: str) -> DataError:
        return DataError(f"{self.where} line {number + 1} {what}: the study's journal is damaged. Restore the "
                         "file (on an s3:// root, an earlier version of the published copy), or delete the study's "
                         "folder to start a new study")

    # -- one record ------------------------------------------------------------------------

    def _admit(self, number: int, record: dict[str, Any]) -> dict[str, Any]:
        op = record["op_code"]
        if op in (CREATE_STUDY, DELETE_STUDY, SET_STUDY_USER_ATTR, SET_STUDY_SYSTEM_ATTR, DISCARD_TRIALS):
            return self._study_record(number, op, record)
        if op == CREATE_TRIAL:
            return self._create_trial(number, record)
        if op in (SET_TRIAL_PARAM, SET_TRIAL_STATE_VALUES, SET_TRIAL_INTERMEDIATE_VALUE, SET_TRIAL_USER_ATTR,
                  SET_TRIAL_SYSTEM_ATTR):
            return self._trial_record(number, op, record)
        raise self._damage(number, f"has an unknown op_code {op}")

    def _study_record(self, number: int, op: int, record: dict[str, Any]) -> dict[str, Any]:
        if op == CREATE_STUDY:
            name, directions = record.get("study_name"), record.get("directions")
            if not isinstance(name, str) or not (isinstance(directions, list) and directions
                                                 and all(d in (1, 2) for d in directions)):
                raise self._damage(number, "creates a study without a name or directions")
            if name != self.study_name:
                return self._ignored(number, f"creates another study ({name!r})")
            if self.study_id is None:  # a repeat is each open's create_study(load_if_exists): Optuna skips it
                self.study_id = 0
            return record
        if op == SET_STUDY_USER_ATTR and record.get("study_id") == self.study_id:
            attr = record.get("user_attr")
            try:
                key, value = _one(attr)
                seed = re.fullmatch(r"seed:(\d{1,5}):(\d)", key) if isinstance(key, str) else None
                if seed is not None:
                    self._seed_record(int(seed[1]), int(seed[2]), value)
                elif key not in STUDY_ATTRS:
                    raise _Refused(f"{key!r} is not a study attribute this study writes")
                else:
                    _seconds(value)
            except (ValueError, TypeError) as err:
                return self._ignored(number, f"study attribute: {err}")
            return record
        what = {DELETE_STUDY: "deletes a study", SET_STUDY_SYSTEM_ATTR: "sets a study system attribute",
                DISCARD_TRIALS: "discards trials"}.get(op, "sets another study's attribute")
        return self._ignored(number, what)

    def _seed_record(self, trial: int, repeat: int, value: Any) -> None:
        """A seed retrain's outcome (`Study.seed_records`): of a finished trial of this study."""
        if trial not in self._trials or self._trials[trial].state != COMPLETE:
            raise _Refused(f"a seed retrain of trial {trial}, which is not a finished trial of this study")
        if not 1 <= repeat <= MAX_TUNE_SEEDS:
            raise _Refused(f"seed retrain {repeat} is not 1 to {MAX_TUNE_SEEDS}")
        if not isinstance(value, dict) or set(value) != {"run_key", "billed_seconds", "value"}:
            raise _Refused("a seed retrain's record holds exactly run_key, billed_seconds and value")
        _run_key(value["run_key"])
        _seconds(value["billed_seconds"])
        if value["value"] is not None:
            _score(value["value"])

    def _create_trial(self, number: int, record: dict[str, Any]) -> dict[str, Any]:
        if record.get("study_id") != self.study_id or self.study_id is None:
            return self._ignored(number, "creates a trial of another study")
        trial_id = self._next_trial_id
        self._next_trial_id += 1
        try:
            state = record.get("state", RUNNING)
            if state not in (RUNNING, COMPLETE, PRUNED, FAIL, WAITING) or isinstance(state, bool):
                raise _Refused(f"state {state!r} is not a trial state")
            trial = _Trial(state=state)
            self._times(record, ("datetime_start", "datetime_complete"))
            self._values(record)
            distributions = record.get("distributions", {})
            params = record.get("params", {})
            if not isinstance(distributions, dict) or not isinstance(params, dict) or set(params) - set(distributions):
                raise _Refused("its params and distributions do not match")
            for key, internal in params.items():
                trial.params[key] = self._param(key, distributions[key], internal)
            values = record.get("intermediate_values", {})
            if not isinstance(values, dict):
                raise _Refused("intermediate_values must be a mapping")
            for step, value in values.items():
                if not str(step).isdigit():
                    raise _Refused(f"intermediate step {step!r} is not a step")
                _score(value)
            self._trials[trial_id] = trial
            for key, value in (record.get("user_attrs") or {}).items():
                self._user_attr(trial_id, key, value)
            for key, value in (record.get("system_attrs") or {}).items():
                self._system_attr(key, value)
        except (ValueError, TypeError, AttributeError) as err:  # _Refused is a ValueError
            self._trials[trial_id] = _Trial(state=FAIL)
            self._refuse(number, trial_id, str(err))
            return {"op_code": CREATE_TRIAL, "worker_id": REFUSED_WORKER, "study_id": self.study_id,
                    "datetime_start": None, "state": FAIL, "datetime_complete": _now()}
        return record

    def _trial_record(self, number: int, op: int, record: dict[str, Any]) -> dict[str, Any]:
        trial_id = record.get("trial_id")
        trial = self._trials.get(trial_id) if isinstance(trial_id, int) and not isinstance(trial_id, bool) else None
        if trial is None:
            return self._ignored(number, f"names trial id {trial_id!r}, which this study does not have")
        assert isinstance(trial_id, int)
        if trial.state in _FINISHED:
            return record  # Optuna ignores updates to a finished trial from another writer
        try:
            if op == SET_TRIAL_PARAM:
                key = record.get("param_name")
                trial.params[str(key)] = self._param(key, record.get("distribution"), record.get("param_value_internal"))
            elif op == SET_TRIAL_STATE_VALUES:
                state = record.get("state")
                if state not in (RUNNING, COMPLETE, PRUNED, FAIL, WAITING) or isinstance(state, bool):
                    raise _Refused(f"state {state!r} is not a trial state")
                self._times(record, ("datetime_start", "datetime_complete"))
                self._values(record)
                if state in _FINISHED and not isinstance(record.get("datetime_complete"), str):
                    raise _Refused("a finished trial needs datetime_complete")
                if state == RUNNING and not isinstance(record.get("datetime_start"), str):
                    raise _Refused("a running trial needs datetime_start")
                trial.state = state
            elif op == SET_TRIAL_INTERMEDIATE_VALUE:
                _count(record.get("step"))
                _score(record.get("intermediate_value"))
            else:
                attr = record.get("user_attr" if op == SET_TRIAL_USER_ATTR else "system_attr")
                key, value = _one(attr)
                (self._user_attr(trial_id, key, value) if op == SET_TRIAL_USER_ATTR
                 else self._system_attr(key, value))
        except (ValueError, TypeError, AttributeError) as err:  # _Refused is a ValueError
            trial.state = FAIL
            self._refuse(number, trial_id, str(err))
            return {"op_code": SET_TRIAL_STATE_VALUES, "worker_id": REFUSED_WORKER, "trial_id": trial_id,
                    "state": FAIL, "values": None, "datetime_complete": _now()}
        return record

    # -- values ------------------------------------------------------------------------------

    def _param(self, key: Any, distribution: Any, internal: Any) -> None | bool | int | float | str:
        from optuna.distributions import json_to_distribution

        if key not in self.dims:
            raise _Refused(f"parameter {key!r} is not a key of tune.space")
        try:
            given = json_to_distribution(distribution) if isinstance(distribution, str) else None
        except (ValueError, KeyError, TypeError):
            given = None
        expected = self._distributions[key]
        if given != expected:
            raise _Refused(f"parameter {key!r} has another distribution than tune.space's")
        if isinstance(internal, bool) or not isinstance(internal, (int, float)) or not expected._contains(internal):
            raise _Refused(f"parameter {key!r}: {internal!r} is outside tune.space's {self.dims[key].kind} range")
        return expected.to_external_repr(internal)

    def _user_attr(self, trial_id: int, key: Any, value: Any) -> None:
        if key == "params":
            self._check_params(self._trials[trial_id], value)
        elif key == "sent_to":
            if _count(value) not in self.rungs:
                raise _Refused(f"sent_to {value!r} is not a rung ({sorted(self.rungs)})")
        elif key in TRIAL_ATTRS:
            try:
                TRIAL_ATTRS[key](value)
            except _Refused as err:
                raise _Refused(f"{key} {err}") from None
        else:
            raise _Refused(f"{key!r} is not a trial attribute this study writes")

    def _check_params(self, trial: _Trial, value: Any) -> None:
        """The `params` attribute (what the trial trains with): exactly the space's keys, each in
        its distribution, and equal to the trial's Optuna parameters where those are known."""
        try:
            params = json.loads(value) if isinstance(value, str) else None
        except ValueError:
            params = None
        if not isinstance(params, dict):
            raise _Refused("params is not a JSON object of tune.space's keys")
        for key in params:
            if key not in self.dims:
                raise _Refused(f"params sets {key!r}, which is not a key of tune.space")
        for key, dim in self.dims.items():
            if key not in params:
                raise _Refused(f"params lacks {key!r}")
            raw = dim.param_of(params[key])
            if raw is None:
                raise _Refused(f"params {key}={params[key]!r} is outside tune.space's {dim.kind} range")
            if key in trial.params and trial.params[key] != raw:
                raise _Refused(f"params {key}={params[key]!r} is not the trial's sampled value")

    def _system_attr(self, key: Any, value: Any) -> None:
        if key == "fixed_params":  # Optuna's enqueue_trial: the study's first trial
            if not isinstance(value, dict) or set(value) != set(self.dims):
                raise _Refused("fixed_params must hold each key of tune.space")
            for name, raw in value.items():
                if raw != self.dims[name].param_of(self.dims[name].value(raw) if self.dims[name].kind == "choice"
                                                    else raw):
                    raise _Refused(f"fixed_params {name}={raw!r} is outside tune.space")
        elif isinstance(key, str) and re.fullmatch(r"completed_rung_\d{1,3}", key):  # SuccessiveHalvingPruner
            _score(value)
        elif isinstance(key, str) and re.fullmatch(r"tpe:relative_params:\d{1,4}", key):
            # TPE's joint suggestion for the trial (multivariate, constant liar), in chunks of
            # JSON text: only a suggestion, whose values the parameters' own lines still pass.
            if not isinstance(value, str) or len(value) > 4096:
                raise _Refused(f"{key} must be a piece of JSON text")
        else:
            raise _Refused(f"{key!r} is not a trial system attribute of this study")

    @staticmethod
    def _times(record: dict[str, Any], keys: tuple[str, ...]) -> None:
        for key in keys:
            value = record.get(key)
            if value is None:
                continue
            try:
                datetime.fromisoformat(value)
            except (TypeError, ValueError):
                raise _Refused(f"{key} {value!r} is not a time") from None

    @staticmethod
    def _values(record: dict[str, Any]) -> None:
        if record.get("value") is not None:
            _score(record["value"])
        values = record.get("values")
        if values is not None:
            if not isinstance(values, list) or len(values) != 1:
                raise _Refused("values must be one number")
            _score(values[0])

    # -- refusals ----------------------------------------------------------------------------

    def _refuse(self, number: int, trial_id: int, why: str) -> None:
        self.refusals.append(Refusal(number + 1, trial_id, why))
        log.warning("%s line %d: trial %d refused (%s); it is skipped as failed, never trained", self.where,
                    number + 1, trial_id, why)

    def _ignored(self, number: int, why: str) -> dict[str, Any]:
        self.refusals.append(Refusal(number + 1, None, why))
        log.warning("%s line %d %s: ignored", self.where, number + 1, why)
        # Deletes a study that does not exist: Optuna replays it as nothing, and counts the line.
        return {"op_code": DELETE_STUDY, "worker_id": REFUSED_WORKER, "study_id": -1}


def _one(attr: Any) -> tuple[Any, Any]:
    """The one (key, value) of an attribute record."""
    if not isinstance(attr, dict) or len(attr) != 1:
        raise _Refused("an attribute record sets exactly one key")
    return next(iter(attr.items()))


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()
