"""What every run teaches the next plan, and what a plan hands the next run.

- `plan/step_times.json` under the storage root: each run's measured seconds per step on its
  instance type, with the step's signature (parameters, FLOPs, micro-batch, precision) and the
  prediction for that instance. `retrain plan` uses a measurement of the same step on the same
  instance type instead of predicting it, and the measured/predicted ratios of a model family
  scale its predictions for the other GPUs.
- `plan/choice.json`: `retrain plan`'s pick, which `cost.instance_type: auto` runs take.
"""

from __future__ import annotations

import json
import logging
import math
import re
import statistics
import time

from pydantic import BaseModel, ConfigDict, ValidationError

from training.config import RetrainConfig
from training.cost.hardware import GPUS
from training.cost.planner import MAX_ACCUMULATION, PLAN_KEYS, Calibrated, PlanRow
from training.cost.roofline import predict_step
from training.cost.step_count import StepCount
from training.errors import ConfigError, RetrainError
from training.storage.files import write_json_atomic
from training.storage.root import RUN, StorageRoot

__all__ = ["PlanChoice", "StepTime", "StepTimeBook", "family_of", "resolve_planned_instance", "signature_of",
           "step_time_of_run", "store_choice"]

BOOK, CHOICE = "plan/step_times.json", "plan/choice.json"
log = logging.getLogger(__name__)
KEEP = 500  # newest records kept


def signature_of(count: StepCount) -> str:
    """Which step a measurement is of: equal models, batches and precisions count equal."""
    return f"{count.parameters}:{count.flops:.6g}:{count.micro_batch}:{count.precision}"


def family_of(config: RetrainConfig) -> str:
    """Model families calibrate separately: their kernels differ (matmuls, attention, convolutions)."""
    if config.model.factory is not None:
        return f"factory:{config.model.factory}"
    return "image" if config.data.image else "text" if config.data.text else "tabular"


class StepTime(BaseModel):
    """One run's step time on its instance, against what was predicted for it."""

    instance_type: str
    gpu: str | None
    device: str
    family: str
    signature: str
    actual_seconds: float
    predicted_seconds: tuple[float, float, float] | None = None
    recorded: bool = False  # False when the run's device was not the instance type's (e.g. CPU for a GPU type)
    run_key: str = ""
    at: float = 0.0

    def plausible(self) -> bool:
        """Step times a run can have measured: positive and finite (and under a day a step)."""
        times = [self.actual_seconds, *(self.predicted_seconds or ())]
        return all(math.isfinite(t) and 0 < t < 86_400 for t in times)


class StepTimeBook(BaseModel):
    records: list[StepTime] = []

    @classmethod
    def load(cls, root: StorageRoot) -> StepTimeBook:
        """The root's book. A damaged book only loses calibration (plans fall back to
        predictions), and a record whose times are not positive and finite is left out with a
        warning: the file is input from whoever can write the root."""
        shown = root.display(BOOK)
        try:
            path = root.fetch(BOOK, fresh=True)
            book = cls() if path is None else cls.model_validate_json(path.read_bytes())
        except (OSError, ValueError, RetrainError) as err:
            log.warning("%s is unreadable (%s): planning without its measurements", shown, str(err).splitlines()[0])
            return cls()
        kept = [r for r in book.records if r.plausible()]
        if len(kept) < len(book.records):
            bad = [f"{r.instance_type} {r.actual_seconds!r} s" for r in book.records if not r.plausible()]
            log.warning("%s: left out %d records whose step times are not positive and finite (%s)", shown,
                        len(bad), ", ".join(bad[:3]) + (", ..." if len(bad) > 3 else ""))
        return cls(records=kept)

    def add(self, root: StorageRoot, record: StepTime) -> None:
        """Append and publish (runs on one root never train at once: the root's lease). The
        book is derived data: a root where it cannot be written loses calibration, not the run."""
        self.records = [*self.records, record][-KEEP:]
        try:
            write_json_atomic(root.path(BOOK), self.model_dump(mode="json"))
            root.publish(BOOK, RUN)
        except (OSError, RetrainError) as err:
            log.warning("cannot write %s (%s): this run's step time is not recorded", root.display(BOOK),
                        str(err).splitlines()[0])

    def calibration(self, family: str, signature: str) -> Calibrated:
        """The measurements of this exact step per instance type, and the family's
        measured/predicted ratios."""
        mine = [r for r in self.records if r.recorded]
        measured = {r.instance_type: r.actual_seconds for r in mine if r.signature == signature}
        ratios = [r.actual_seconds / r.predicted_seconds[1] for r in mine
                  if r.family == family and r.predicted_seconds is not None and r.predicted_seconds[1] > 0]
        if not ratios:
            return Calibrated(measured=measured)
        return Calibrated(measured=measured, runs=len(ratios), factor=statistics.median(ratios),
                          factor_range=(min(ratios), max(ratios)))


def step_time_of_run(config: RetrainConfig, count: StepCount, device: str, seconds_per_step: float,
                     run_key: str, world_size: int = 1) -> StepTime:
    """This run's step time, with the prediction for its instance type when it has a GPU. Under
    DDP `count` is one rank's micro-batch: the instance's GPUs are shared among the ranks."""
    price = config.cost.prices[config.cost.instance_type]
    predicted = None
    if price.gpu is not None:
        gpus = max(1, price.gpus // max(1, world_size))
        p = predict_step(count, GPUS[price.gpu], gpus, config.train.precision)
        predicted = (p.low, p.mid, p.high)
    matches = (device == "cuda") == (price.gpu is not None)
    return StepTime(instance_type=config.cost.instance_type, gpu=price.gpu, device=device,
                    family=family_of(config), signature=signature_of(count), actual_seconds=seconds_per_step,
                    predicted_seconds=predicted, recorded=matches, run_key=run_key, at=time.time())


class PlanChoice(BaseModel):
    """`plan/choice.json`: input from whoever can write the storage root, so it may set only what
    a plan decides (the instance, the market and `PLAN_KEYS`), each validated by the config."""

    model_config = ConfigDict(extra="forbid")

    instance_type: str
    market: str
    set: dict[str, str] = {}
    planned_at: float


def store_choice(config: RetrainConfig, row: PlanRow) -> None:
    root = StorageRoot.from_config(config)
    choice = PlanChoice(instance_type=row.instance_type, market=row.market, set=row.set, planned_at=time.time())
    write_json_atomic(root.path(CHOICE), choice.model_dump(mode="json"))
    root.publish(CHOICE, RUN)


_INTEGER = re.compile(r"[1-9][0-9]{0,8}")  # a plan writes str(int): never a sign, a point or an exponent
_PRECISIONS = ("auto", "bf16", "fp16", "fp32")


def _plan_values(config: RetrainConfig, choice: PlanChoice, shown: str) -> dict[str, str | int | bool]:
    """The stored pick's settings, each parsed as strictly as a plan writes it (an integer is
    digits, never "8.0"; a flag is "true" or "false"), then bounded: a plan's memory variant
    splits the configured batch into at most MAX_ACCUMULATION micro-batches and never changes
    the effective batch (`training.cost.planner.variants`). A pick that does otherwise was not
    written by a plan."""
    values: dict[str, str | int | bool] = {}
    for key, text in choice.set.items():
        if key in ("train.batch_size", "train.grad_accum"):
            if not _INTEGER.fullmatch(text):
                raise ConfigError(f"{shown}: {key}={text!r} is not a whole number as a plan writes it (digits only); "
                                  "run `retrain plan` again to replace the file")
            values[key] = int(text)
        elif key == "model.gradient_checkpointing":
            if text not in ("true", "false"):
                raise ConfigError(f"{shown}: {key}={text!r} is not true or false; run `retrain plan` again to replace "
                                  "the file")
            values[key] = text == "true"
        elif key == "train.precision":
            if text not in _PRECISIONS:
                raise ConfigError(f"{shown}: {key}={text!r} is not one of {', '.join(_PRECISIONS)}; run `retrain plan` "
                                  "again to replace the file")
            values[key] = text
    train = config.train
    batch = int(values.get("train.batch_size", train.batch_size))
    accumulation = int(values.get("train.grad_accum", train.grad_accum))
    if not 1 <= accumulation <= max(MAX_ACCUMULATION, train.grad_accum):
        raise ConfigError(f"{shown}: train.grad_accum={accumulation} is not one a plan picks (1 to "
                          f"{MAX_ACCUMULATION}); run `retrain plan` again to replace the file")
    if batch * accumulation != train.batch_size * train.grad_accum:
        raise ConfigError(f"{shown}: train.batch_size x train.grad_accum = {batch} x {accumulation} is not the "
                          f"configured effective batch {train.batch_size} x {train.grad_accum}; a plan keeps it. "
                          "Run `retrain plan` again to replace the file")
    return values


def resolve_planned_instance(config: RetrainConfig) -> RetrainConfig:
    """`cost.instance_type: auto`: the instance type, market and memory variant of the last
    `retrain plan` on this storage root."""
    if config.cost.instance_type != "auto":
        return config
    root = StorageRoot.from_config(config)
    path = root.fetch(CHOICE, fresh=True)
    if path is None:
        raise ConfigError(f"cost.instance_type is auto but no plan is stored at {root.display(CHOICE)}; run "
                          "`retrain plan` with this storage.root first, or name the instance type")
    shown = root.display(CHOICE)
    try:
        choice = PlanChoice.model_validate(json.loads(path.read_text()))
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the top level"
        raise ConfigError(f"{shown}: {where}: {first['msg']}; run `retrain plan` again to replace the file") from None
    except (OSError, ValueError):
        raise ConfigError(f"{shown} is not a readable plan choice; run `retrain plan` again") from None
    if choice.instance_type == "auto":
        raise ConfigError(f"{shown}: instance_type must name an instance type, not 'auto'; run `retrain plan` again")
    refused = sorted(key for key in choice.set if key not in PLAN_KEYS)
    if refused:
        raise ConfigError(f"{shown}: a plan may set only {', '.join(sorted(PLAN_KEYS))}, not {refused[0]!r}; "
                          "run `retrain plan` again to replace the file")
    values = {"cost.instance_type": choice.instance_type, "cost.market": choice.market,
              **_plan_values(config, choice, shown)}
    return config.with_values(values, f"the plan in {shown}")
