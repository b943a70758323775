"""What one optimizer step costs, by shapes and dtypes: counted by
`training.trainer.step_cost` on the real model, priced by `training.cost.roofline`."""

from __future__ import annotations

from pydantic import BaseModel

__all__ = ["StepCount", "StepCosts"]


class StepCount(BaseModel):
    """One optimizer step at `micro_batch` rows, by shapes: what a GPU would have to do."""

    micro_batch: int
    precision: str  # "fp32" or "bf16" (autocast); fp16 moves the same bytes as bf16
    gradient_checkpointing: bool
    flops: float  # forward + backward (+ recompute) matmul/conv/attention FLOPs
    matmul_bytes: float  # bytes read and written by those ops
    other_bytes: float  # bytes read and written by every other kernel (elementwise, reductions, copies)
    kernels: int  # ops that launch a kernel (views and metadata ops excluded), optimizer included
    parameters: int
    parameter_bytes: int
    activation_bytes: int  # held for backward at the peak, inputs included
    optimizer_bytes: float  # AdamW's traffic


class StepCosts(BaseModel):
    """The counts `retrain plan` needs: as configured, and in the variants it may propose."""

    as_run: StepCount
    bf16: StepCount
    checkpointed: StepCount | None  # None: the model has no gradient_checkpointing switch
    fp32: StepCount | None = None  # without autocast, when the run is configured for a half precision
