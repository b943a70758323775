"""`cost` and `budget`: what the machine costs (instance types, markets, prices, tags) and the
limits that stop a run gracefully."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from training.config.marks import OPERATIONAL
from training.config.prices import DEFAULT_PRICES, DEFAULT_STORAGE_PRICES
from training.config.section import _Section
from training.cost.hardware import GPUS
from training.errors import ConfigError

__all__ = ["BudgetConfig", "CostConfig", "InstancePrice"]


class InstancePrice(_Section):
    gpus: int = Field(0, ge=0, description="Accelerators on the instance.", json_schema_extra=OPERATIONAL)
    gpu_memory_gb: float | None = Field(None, gt=0, description="Memory of each accelerator in GB; `retrain plan` "
                                        "refuses the instance for a model that would not fit. Empty: not checked.",
                                        json_schema_extra=OPERATIONAL)
    on_demand_per_hour: float = Field(ge=0, description="On-demand $/h for the whole instance.", json_schema_extra=OPERATIONAL)
    spot_per_hour: float | None = Field(None, ge=0, description="Spot $/h for the whole instance; empty: not offered.", json_schema_extra=OPERATIONAL)
    relative_speed: float = Field(
        1.0, gt=0, description="Training throughput relative to the machine `retrain plan` calibrates on; used only "
        "for an instance without a `gpu` (a GPU's step time is predicted from its published figures).",
        json_schema_extra=OPERATIONAL
    )
    gpu: str | None = Field(None, description="The GPU model, a key of training.cost.hardware.GPUS (T4, A10G, "
                            "V100-16GB, A100-40GB, A100-80GB, A100-80GB-PCIe, H100): `retrain plan` predicts its step "
                            "time from the GPU's published throughput and bandwidth.", json_schema_extra=OPERATIONAL)
    vcpus: int | None = Field(None, gt=0, description="The host's vCPUs: `retrain plan` caps a GPU's step rate at what "
                              "they can load, from this machine's measured loading pace per core; without a `gpu`, it "
                              "predicts the step from this machine's, carried to the instance's cores.",
                              json_schema_extra=OPERATIONAL)
    memory_gb: float | None = Field(None, gt=0, description="The host's memory in GB: `retrain plan` refuses an "
                                    "instance without a `gpu` whose memory the training would not fit.",
                                    json_schema_extra=OPERATIONAL)
    interruption_band: Literal["<5%", "5-10%", "10-15%", "15-20%", ">20%"] | None = Field(
        None, description="Monthly spot interruption frequency band (AWS Spot Instance Advisor); empty: the shipped "
        "band for cost.region, else train.checkpoint.mean_seconds_between_preemptions.", json_schema_extra=OPERATIONAL)

    measured_step_seconds: float | None = Field(
        None, gt=0, description="Seconds per optimizer step measured on this instance type for this model (a run's "
        "report: `plan.actual_step_seconds`); `retrain plan` uses it instead of the prediction.",
        json_schema_extra=OPERATIONAL)

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, v: str | None) -> str | None:
        if v is not None and v not in GPUS:
            raise ValueError(f"unknown GPU {v!r}; known: {', '.join(GPUS)}")
        return v




class CostConfig(_Section):
    instance_type: str = Field("local-cpu", description="The instance type this run runs on (a key of cost.prices), "
                               "or auto: the pick of the last `retrain plan` on this storage root, with the memory "
                               "variant it chose.", json_schema_extra=OPERATIONAL)
    market: Literal["on_demand", "spot"] = Field("on_demand", description="Market this run is billed on.", json_schema_extra=OPERATIONAL)
    region: str = Field("us-east-1", description="Cloud region whose shipped spot interruption bands `retrain plan` "
                        "uses (us-east-1, us-west-2, eu-west-1).", json_schema_extra=OPERATIONAL)
    prices: dict[str, InstancePrice] = Field(
        {k: InstancePrice(**v) for k, v in DEFAULT_PRICES.items()},
        description="Instance type -> GPUs and $/h; entries given here are merged over the defaults.", json_schema_extra=OPERATIONAL
    )
    storage_per_gb_month: dict[str, float] = Field(
        dict(DEFAULT_STORAGE_PRICES), description="$/GB-month per storage class.", json_schema_extra=OPERATIONAL
    )
    storage_class: dict[str, str] = Field(
        {"shards": "STANDARD", "checkpoints": "STANDARD", "models": "STANDARD"},
        description="Storage class per object class (shards, checkpoints, models).", json_schema_extra=OPERATIONAL
    )
    retention_days: dict[str, float] = Field(
        {"shards": 30.0, "checkpoints": 7.0, "models": 365.0},
        description="Days each object class is kept, for the storage estimate.", json_schema_extra=OPERATIONAL
    )
    tags: dict[str, str] = Field(
        {}, description="Cost-allocation tags (e.g. team, project, owner) for the report and objects.", json_schema_extra=OPERATIONAL
    )

    @field_validator("prices", mode="before")
    @classmethod
    def _merge_prices(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        merged: dict[str, Any] = {k: dict(p) for k, p in DEFAULT_PRICES.items()}
        for name, entry in v.items():
            if isinstance(entry, BaseModel):
                entry = entry.model_dump()
            merged[name] = {**merged.get(name, {}), **entry} if isinstance(entry, dict) else entry
        return merged

    @field_validator("tags")
    @classmethod
    def _object_tags(cls, v: dict[str, str]) -> dict[str, str]:
        # S3 allows 10 tags per object; the pipeline adds retrain-class and retrain-run.
        if len(v) > 8:
            raise ValueError(f"cost.tags has {len(v)} tags; S3 objects take at most 8 besides the pipeline's 2")
        for key, value in v.items():
            if not key or len(key) > 128 or len(value) > 256 or key.lower().startswith(("aws:", "retrain-")):
                raise ValueError(f"cost.tags.{key}: keys are 1-128 characters, values up to 256, and "
                                 "'aws:' and 'retrain-' prefixes are reserved")
        return v

    @model_validator(mode="after")
    def _known_instance(self) -> CostConfig:
        if self.instance_type == "auto":
            pass  # the last `retrain plan`'s pick, resolved when the run starts
        elif self.instance_type not in self.prices:
            raise ValueError(
                f"cost.instance_type {self.instance_type!r} has no entry in cost.prices "
                f"(known: {sorted(self.prices)}); add one to your config"
            )
        elif self.market == "spot" and self.prices[self.instance_type].spot_per_hour is None:
            raise ValueError(f"cost.market is spot but cost.prices[{self.instance_type!r}].spot_per_hour is empty")
        for cls_name in ("shards", "checkpoints", "models"):
            storage_class = self.storage_class.get(cls_name)
            if storage_class not in self.storage_per_gb_month:
                raise ValueError(f"cost.storage_class.{cls_name}: {storage_class!r} has no price in cost.storage_per_gb_month")
            if cls_name not in self.retention_days:
                raise ValueError(f"cost.retention_days.{cls_name} is missing")
        return self

    def rate(self) -> tuple[float, int]:
        """($/h, GPUs) of the declared instance on the declared market."""
        if self.instance_type == "auto":
            raise ConfigError("cost.instance_type is auto: the run resolves it from the last `retrain plan` "
                              "(training.registry.step_times.resolve_planned_instance) before pricing")
        entry = self.prices[self.instance_type]
        rate = entry.spot_per_hour if self.market == "spot" else entry.on_demand_per_hour
        return float(rate or 0.0), entry.gpus


class BudgetConfig(_Section):
    max_usd: float | None = Field(None, gt=0, description="Stop training before the run's bill would exceed this.", json_schema_extra=OPERATIONAL)
    max_gpu_hours: float | None = Field(None, gt=0, description="Stop training before GPU-hours would exceed this.", json_schema_extra=OPERATIONAL)
    max_wall_seconds: float | None = Field(None, gt=0, description="Stop training before the run's wall time would exceed this.", json_schema_extra=OPERATIONAL)
    champion_gate: bool = Field(
        False, description="Stop early when the validation AUC's trend cannot reach the champion's plus eval.min_delta.", json_schema_extra=OPERATIONAL
    )


# S3 storage classes a lifecycle rule may transition to (PutBucketLifecycleConfiguration).
