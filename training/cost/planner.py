"""`retrain plan`'s rows: per instance type and market, the step time (predicted from the GPU's
published figures, or measured), whether the model fits and in which variant, and the expected
hours, cost and chance of meeting the deadline. Pure arithmetic on a calibration and step counts."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict

from training.config import InstancePrice, RetrainConfig
from training.cost.bill import GB
from training.cost.cpu_step import CpuScaling, predict_cpu_step
from training.cost.hardware import GPUS
from training.cost.interruptions import SPOT_BANDS, hourly_rates
from training.cost.roofline import StepPrediction, predict_step, training_bytes
from training.cost.spot_risk import spot_outlook
from training.cost.step_count import StepCosts, StepCount
from training.copies import updated

__all__ = ["DEADLINE_CONFIDENCE", "THIS_MACHINE", "Calibrated", "HereFigures", "PlanRow", "Variant", "plan_rows",
           "recommended", "variants"]

# The recommendation must end by the deadline with at least this probability.
DEADLINE_CONFIDENCE = 0.9
MAX_ACCUMULATION = 8


class HereFigures(BaseModel):
    """What calibration measured on this machine, for the parts that do not run on the GPU."""

    steps: int  # optimizer steps of the whole run
    evals: int  # validations of the whole run
    seconds_per_step: float
    seconds_per_validation: float
    seconds_per_checkpoint: float
    startup_seconds: float
    data_seconds: float  # pack and preprocess
    load_seconds_per_batch: float | None  # one core producing one training batch
    cpu_scaling: CpuScaling | None = None  # one step at one thread against several, here


class Calibrated(BaseModel):
    """What earlier runs measured: this step's seconds per instance type, and the model family's
    measured/predicted ratio (median, and its range) over its runs on GPUs."""

    measured: dict[str, float] = {}
    runs: int = 0
    factor: float = 1.0
    factor_range: tuple[float, float] = (1.0, 1.0)


class Variant(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    set: dict[str, str]  # the keys to set for it
    count: StepCount
    accumulation: int = 1


class PlanRow(BaseModel):
    """One (instance type, market) line of `retrain plan`."""

    model_config = ConfigDict(frozen=True)

    instance_type: str
    market: str
    rate_per_hour: float
    variant: str = "as configured"
    set: dict[str, str] = {}
    step_seconds: tuple[float, float, float] | None = None  # low, middle, high
    step_source: str = ""
    need_gb: float | None = None
    fits: bool = True
    refused: str | None = None
    hours: tuple[float, float, float] = (0.0, 0.0, 0.0)
    cost_usd: tuple[float, float, float] = (0.0, 0.0, 0.0)
    interruptions: float = 0.0  # expected, at the middle estimates
    lost_hours: float = 0.0  # expected work redone and restarts after interruptions
    interruption_band: str | None = None
    checkpoint_every_seconds: float | None = None
    p_deadline: float | None = None
    meets_deadline: bool = True
    here: bool = False  # this machine (a price with neither gpu nor vcpus): shown, never an instance to rent

    def brief(self) -> dict[str, str]:
        """The row in at most 100 characters: instance, market, step, hours, dollars, and why
        (what bounds the step, or why the row is refused)."""
        if not self.fits:
            return {"instance": self.instance_type, "market": self.market, "ms/step": "-", "hours": "-", "$": "-",
                    "why": f"refused: {self.refused or ''}"[:34]}
        mid = (self.step_seconds or (0.0, 0.0, 0.0))[1]
        why = self.step_source.removeprefix("predicted: ").removeprefix("measured ")
        return {"instance": self.instance_type[:22], "market": self.market, "ms/step": f"{mid * 1000:.3g}",
                "hours": f"{self.hours[1]:.3g}", "$": f"{self.cost_usd[1]:.3g}", "why": why[:34]}

    def cells(self) -> dict[str, str]:
        """The row as a person reads it: step times are predictions (with their range) unless
        measured; a refused row says why."""
        if not self.fits:
            return {"instance": self.instance_type, "market": self.market, "variant": "-", "ms/step": "-",
                    "fits": "no", "hours": "-", "cost $": "-", "P(deadline)": "-", "interruptions": "-",
                    "step time": self.refused or ""}
        lo, mid, hi = (f"{s * 1000:.3g}" for s in self.step_seconds or (0.0, 0.0, 0.0))
        usd = self.cost_usd
        return {"instance": self.instance_type, "market": self.market, "variant": self.variant,
                "ms/step": mid if lo == hi else f"{mid} ({lo}-{hi})", "fits": "yes", "hours": f"{self.hours[1]:.4f}",
                "cost $": f"{usd[1]:.4f} ({usd[0]:.4f}-{usd[2]:.4f})",
                "P(deadline)": "-" if self.p_deadline is None else f"{self.p_deadline:.0%}",
                "interruptions": "-" if self.market != "spot" else f"{self.interruptions:.2g}, {self.lost_hours:.2g} h lost"
                + (f" ({self.interruption_band}/month)" if self.interruption_band else ""),
                "step time": self.step_source}


PLAN_KEYS = frozenset({"train.precision", "model.gradient_checkpointing", "train.batch_size", "train.grad_accum"})
"""The only config keys a plan's memory variant sets (`PlanRow.set`): what a stored pick may change."""


def variants(costs: StepCosts, configured_precision: str, micro_batch: int) -> list[Variant]:
    """As configured, then what would cut memory, cheapest in step time first: bf16, gradient
    checkpointing, then smaller micro-batches with accumulation (the same effective batch)."""
    out = [Variant(name="as configured", set={}, count=costs.as_run)]
    if configured_precision == "auto" and costs.fp32 is not None:
        # Priced beside the half precision `auto` takes, not as a memory saving (it holds more):
        # `plan_rows` keeps whichever of the two is cheaper where both fit.
        out.append(Variant(name="fp32", set={"train.precision": "fp32"}, count=costs.fp32))
    if configured_precision == "fp32":
        out.append(Variant(name="bf16", set={"train.precision": "auto"}, count=costs.bf16))
    if costs.checkpointed is not None:
        out.append(Variant(name="gradient checkpointing", set={"model.gradient_checkpointing": "true"},
                           count=costs.checkpointed))
    base = costs.checkpointed or costs.as_run
    k = 2
    while k <= MAX_ACCUMULATION and micro_batch // k >= 1:
        # Activations shrink with the micro-batch; each optimizer step launches k times the
        # kernels and reads the weights k times.
        count = updated(base, {
            "activation_bytes": int(base.activation_bytes / k), "kernels": base.kernels * k,
            "matmul_bytes": base.matmul_bytes + (k - 1) * 3 * base.parameter_bytes})
        out.append(Variant(name=f"micro-batch {micro_batch // k} x {k} accumulated", accumulation=k, count=count,
                           set={**({"model.gradient_checkpointing": "true"} if costs.checkpointed else {}),
                                "train.batch_size": str(micro_batch // k), "train.grad_accum": str(k)}))
        k *= 2
    return out


def _work_hours(here: HereFigures, step: float) -> float:
    """The run's hours at `step` seconds per step: steps, validations scaled by the same
    speed-up, start-up and pack and preprocess (the host's work, as measured here)."""
    evals = here.evals * here.seconds_per_validation * step / max(here.seconds_per_step, 1e-9)
    return (here.data_seconds + here.startup_seconds + step * here.steps + evals) / 3600.0


def _measured(seconds: float, source: str) -> tuple[StepPrediction, str]:
    return StepPrediction(low=seconds, mid=seconds, high=seconds, precision="", bound="measured"), source


def _step_for(name: str, price: InstancePrice, variant: Variant, config: RetrainConfig, here: HereFigures,
              calibrated: Calibrated) -> tuple[StepPrediction, str]:
    if price.measured_step_seconds is not None:
        return _measured(price.measured_step_seconds, "measured on the instance (cost.prices)")
    if name in calibrated.measured and variant.name == "as configured":
        return _measured(calibrated.measured[name], "measured on the instance by an earlier run")
    if price.gpu is None and price.vcpus is not None:
        cpu = predict_cpu_step(here.seconds_per_step * variant.accumulation, here.cpu_scaling, price.vcpus,
                               price.relative_speed, config.train.grad_accum * variant.accumulation)
        how = "measured" if cpu.measured_share else "assumed"
        base = "CPU time" if cpu.from_cpu_time else "wall time"
        return (StepPrediction(low=cpu.low, mid=cpu.mid, high=cpu.high, precision="fp32", bound="cpu"),
                f"predicted: {cpu.cores} core(s) x this machine's step ({base}), share {cpu.share:.2f} ({how})")
    if price.gpu is None:
        return _measured(here.seconds_per_step / price.relative_speed,
                         f"measured here / relative_speed {price.relative_speed:g}")
    precision = variant.set.get("train.precision", config.train.precision)
    pred = predict_step(variant.count, GPUS[price.gpu], price.gpus, precision)
    source = f"predicted: {price.gpu} {pred.precision}, {pred.bound}-bound"
    if calibrated.runs:
        low, high = calibrated.factor_range
        pred = updated(pred, {"low": pred.low * low,
                                       "mid": pred.mid * calibrated.factor, "high": pred.high * high})
        source += f", x{calibrated.factor:.2g} from {calibrated.runs} measured run(s)"
    if here.load_seconds_per_batch is not None and price.vcpus is not None:
        # The host's cores (one kept for the training process) load batches at this machine's
        # measured pace per core: a GPU that would wait on data is not faster.
        floor = here.load_seconds_per_batch * variant.accumulation / max(1, price.vcpus - 1)
        if floor > pred.low:
            pred = StepPrediction(low=max(floor, pred.low), mid=max(floor, pred.mid), high=max(floor, pred.high),
                                  precision=pred.precision, bound="data")
            source = f"predicted: {price.gpu} waits on data ({price.vcpus} vCPUs)"
    return pred, source


def _interruption_rates(name: str, price: InstancePrice, config: RetrainConfig
                        ) -> tuple[tuple[float, float, float], str | None]:
    band = price.interruption_band or SPOT_BANDS.get(config.cost.region, {}).get(name)
    if band is None:
        rate = 3600.0 / config.train.checkpoint.mean_seconds_between_preemptions
        return (rate, rate, rate), None
    return hourly_rates(band), band


def _row(name: str, market: str, rate: float, price: InstancePrice, variant: Variant, config: RetrainConfig,
         here: HereFigures, deadline: float | None, calibrated: Calibrated) -> PlanRow:
    pred, source = _step_for(name, price, variant, config, here, calibrated)
    rates, band = _interruption_rates(name, price, config) if market == "spot" else ((0.0, 0.0, 0.0), None)
    # Optimistic: fast steps and few interruptions; pessimistic: slow steps and many.
    low, mid, high = (spot_outlook(_work_hours(here, s), r, here.seconds_per_checkpoint, here.startup_seconds,
                                   deadline) for s, r in zip((pred.low, pred.mid, pred.high), rates, strict=True))
    p = None if deadline is None else (low.p_deadline or 0.0) / 4 + (mid.p_deadline or 0.0) / 2 + (
        high.p_deadline or 0.0) / 4
    hours = (low.hours, mid.hours, high.hours)
    return PlanRow(instance_type=name, market=market, rate_per_hour=rate, variant=variant.name, set=variant.set,
                   step_seconds=(pred.low, pred.mid, pred.high), step_source=source, hours=hours,
                   cost_usd=(rate * hours[0], rate * hours[1], rate * hours[2]), interruptions=mid.interruptions,
                   lost_hours=mid.lost_hours,
                   interruption_band=band, checkpoint_every_seconds=mid.checkpoint_every_seconds, p_deadline=p,
                   meets_deadline=p is None or p >= DEADLINE_CONFIDENCE)


def _fitting(price: InstancePrice, options: list[Variant]) -> tuple[Variant | None, float | None, str]:
    """The first variant whose training memory fits one of the instance's GPUs (the fp32
    alternative of `auto` is not a memory saving: `_precision_alternative` prices it)."""
    options = [v for v in options if v.name != "fp32"]
    memory = price.gpu_memory_gb or (GPUS[price.gpu].memory_gb if price.gpu else price.memory_gb)
    if memory is None:
        return options[0], None, ""
    # A CPU instance trains as configured: the variants save accelerator memory.
    options = options if price.gpu else options[:1]
    needs = [(v, training_bytes(v.count, max(1, price.gpus))) for v in options]
    for variant, need in needs:
        if need <= memory * GB:
            return variant, need / GB, ""
    least = min(n for _, n in needs)
    return None, needs[0][1] / GB, (f"training needs about {needs[0][1] / GB:.1f} GB a GPU as configured and at least "
                                    f"{least / GB:.1f} GB in any variant (weights, gradients, AdamW state, activations, "
                                    f"{'CUDA context' if price.gpu else 'the process'}); its "
                                    f"{'GPU' if price.gpu else 'memory'} has {memory:g} GB")


def _precision_alternative(price: InstancePrice, variant: Variant, config: RetrainConfig, costs: StepCosts,
                           micro_batch: int) -> tuple[Variant, float | None] | None:
    """`train.precision: auto` on a GPU: fp32 beside the half precision, where it fits as configured."""
    if variant.name != "as configured" or price.gpu is None:
        return None
    fp32 = next((v for v in variants(costs, config.train.precision, micro_batch) if v.name == "fp32"), None)
    if fp32 is None:
        return None
    memory = price.gpu_memory_gb or GPUS[price.gpu].memory_gb
    need = training_bytes(fp32.count, max(1, price.gpus))
    return (fp32, need / GB) if need <= memory * GB else None


def plan_rows(config: RetrainConfig, names: list[str], costs: StepCosts, micro_batch: int,
              figures: HereFigures, deadline: float | None, calibrated: Calibrated | None = None) -> list[PlanRow]:
    """Every (instance, market) row; fitting rows that meet the deadline first, cheapest first,
    and this machine's row last (it is not an instance to rent: `recommended`)."""
    rows = []
    for name in names:
        price = config.cost.prices[name]
        variant, need, why = _fitting(price, variants(costs, config.train.precision, micro_batch))
        # This machine (`local-cpu`): no GPU and no vCPU count to carry a step to, and nothing an
        # hour: no market to rent it on, and never a recommendation.
        here = price.gpu is None and price.vcpus is None and not price.on_demand_per_hour
        markets = [(THIS_MACHINE, price.on_demand_per_hour)] if here else [("on_demand", price.on_demand_per_hour),
                                                                           ("spot", price.spot_per_hour)]
        for market, rate in markets:
            if rate is None:
                continue
            if variant is None:
                rows.append(PlanRow(instance_type=name, market=market, rate_per_hour=rate, need_gb=need, fits=False,
                                    refused=why, hours=(math.inf,) * 3, cost_usd=(math.inf,) * 3,
                                    meets_deadline=False))
                continue
            row = _row(name, market, rate, price, variant, config, figures, deadline, calibrated or Calibrated())
            row = updated(row, {"need_gb": need, "here": here})
            alternative = _precision_alternative(price, variant, config, costs, micro_batch)
            if alternative is not None:
                other, other_need = alternative
                other_row = updated(_row(name, market, rate, price, other, config, figures, deadline,
                                 calibrated or Calibrated()), {"need_gb": other_need})
                row = min(row, other_row, key=lambda r: r.cost_usd[1])
            rows.append(row)
    return sorted(rows, key=lambda r: (r.here, not r.fits, not r.meets_deadline, r.cost_usd[1]))


THIS_MACHINE = "this machine"


def recommended(rows: list[PlanRow]) -> PlanRow | None:
    """The cheapest instance to rent that fits and meets the deadline: never this machine, which
    costs nothing a plan could compare and cannot be rented."""
    return next((r for r in rows if r.fits and r.meets_deadline and not r.here), None)
