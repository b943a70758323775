"""`retrain plan`'s worked example: a cheaper, slower GPU against a dearer, faster one, on the
project's own counts.

The model is the built-in text model at the size `bench_transformer` trains (6 blocks of width
384, 128 tokens, over 10M parameters), at micro-batch 64. One step is counted on this CPU, as
`retrain plan` counts it; the plan's rows then price 20,000 steps on a g5.xlarge (one A10G) and an
a2-highgpu-1g (one A100 40 GB), on demand, under a loose and a tight deadline. Step times and
hours are predictions from the GPUs' published figures (`training/cost/hardware.py`) and the
host's cost per kernel measured by the `gpu` benchmark, not measurements of this model: no GPU
runs here. Start-up (60 s) and a checkpoint's stall (5 s) are assumptions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from training.data.batch import Batch
from training.config import RetrainConfig
from training.cost.planner import HereFigures, plan_rows
from training.cost.step_count import StepCosts
from training.data.prepare.features import FeatureStats
from training.model.network import ModelSchema
from training.model.spec import build_model
from training.model.objectives import BinaryTask
from training.trainer.step_cost import count_step

STEPS = 200_000
BATCH, TOKENS, VOCAB = 64, 128, 8000
INSTANCES = ["g5.xlarge", "a2-highgpu-1g"]


def _count(config: RetrainConfig) -> StepCosts:
    model_config = config.model.model_copy(update={"text_dim": 384, "text_layers": 6, "text_heads": 6, "hidden": []})
    schema = ModelSchema(task="binary", n_outputs=1, numeric=[], categorical=[], cardinalities=[], text=["text"],
                         vocab_size=VOCAB, max_tokens=TOKENS)
    batch = Batch(num=torch.zeros(BATCH, 0), cat=torch.zeros(BATCH, 0, dtype=torch.int64),
                  tok=torch.randint(1, VOCAB, (BATCH, 1, TOKENS)), ntok=torch.full((BATCH, 1), TOKENS),
                  label=torch.randint(0, 2, (BATCH,)).float())
    count = count_step(build_model(model_config, schema), BinaryTask(FeatureStats([], [], [], [], [])), batch,
                       torch.bfloat16)
    return StepCosts(as_run=count, bf16=count, checkpointed=None)


def run(work: Path) -> dict[str, Any]:
    config = RetrainConfig()
    costs = _count(config)
    here = HereFigures(steps=STEPS, evals=0, seconds_per_step=1.0, seconds_per_validation=0.0,
                       seconds_per_checkpoint=5.0, startup_seconds=60.0, data_seconds=0.0, load_seconds_per_batch=None)
    loose = plan_rows(config, INSTANCES, costs, BATCH, here, deadline=None)
    by_name = {r.instance_type: r for r in loose if r.market == "on_demand"}
    slow, fast = by_name["g5.xlarge"], by_name["a2-highgpu-1g"]
    # A deadline past the slower instance's pessimistic hours, and one just past the faster's: the
    # plan wants 90 % confidence, so only then does the faster instance meet it while the slower
    # one (whose middle estimate is later) does not.
    roomy, tight = slow.hours[2] * 1.1, fast.hours[2] * 1.05
    table: dict[str, dict[str, Any]] = {}
    for label, deadline in (("roomy", roomy), ("tight", tight)):
        rows = [r for r in plan_rows(config, INSTANCES, costs, BATCH, here, deadline) if r.market == "on_demand"]
        for rank, r in enumerate(rows, 1):
            cells = r.cells()
            table[f"{label} deadline {deadline:.2f} h, #{rank}"] = {
                "instance": r.instance_type, "ms/step (predicted)": cells["ms/step"], "hours": r.hours[1],
                "$/h": r.rate_per_hour, "cost $": r.cost_usd[1], "P(deadline)": cells["P(deadline)"]}
    count = costs.as_run
    return {"model": "text transformer, 6 blocks x 384, 128 tokens, micro-batch 64, bf16",
            "parameters": count.parameters, "gflop_per_step": count.flops / 1e9,
            "mb_moved_per_step": (count.matmul_bytes + count.other_bytes) / 1e6, "kernels_per_step": count.kernels,
            "steps": STEPS, "plan": table,
            "picked_roomy": next(iter(table.values()))["instance"],
            "picked_tight": [v for k, v in table.items() if k.startswith("tight")][0]["instance"]}
