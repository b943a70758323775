"""`retrain plan`'s step-time model: FLOPs counted on the real model, the roofline over the GPUs'
published figures, memory fit and its variants, expected spot cost and the ranked table."""

from __future__ import annotations

import json
import math

import pytest
import torch

from training.config import RetrainConfig
from training.cost.hardware import GPUS, peak_flops
from training.cost.interruptions import SPOT_BANDS, hourly_rates
from training.cost.planner import HereFigures, plan_rows
from training.cost.roofline import predict_step
from training.cost.spot_risk import spot_outlook, young_daly_seconds
from training.cost.step_count import StepCosts, StepCount
from training.data.prepare.features import FeatureStats
from training.model.network import ModelSchema, forward_fn
from training.model.spec import build_model
from training.model.objectives import BinaryTask
from training.trainer.step_cost import count_step, measure_step_costs
from training.data.batch import Batch

B, N_NUM, HIDDEN = 32, 5, [16, 8]


def _mlp(checkpointing: bool = False) -> torch.nn.Module:
    config = RetrainConfig().model.model_copy(update={"numeric_embedding": "none", "hidden": HIDDEN,
                                                      "gradient_checkpointing": checkpointing, "dropout": 0.0})
    schema = ModelSchema(task="binary", n_outputs=1, numeric=[f"x{i}" for i in range(N_NUM)], categorical=[],
                         cardinalities=[])
    return build_model(config, schema)


def _batch() -> Batch:
    return Batch(num=torch.randn(B, N_NUM), cat=torch.zeros(B, 0, dtype=torch.int64),
                 label=torch.randint(0, 2, (B,)).float())


TASK = BinaryTask(FeatureStats([], [], [], [], []))


def test_the_mlps_flops_are_the_hand_count() -> None:
    """Forward 2·B·in·out per linear layer; backward the same for the weight gradients, and again
    for the input gradients of every layer but the first (its input needs no gradient)."""
    widths = [N_NUM, *HIDDEN, 1]
    layers = [a * b for a, b in zip(widths, widths[1:], strict=False)]
    hand = 2 * B * sum(layers) * 2 + 2 * B * sum(layers[1:])
    count = count_step(_mlp(), TASK, _batch(), None)
    assert count.flops == hand
    assert count.parameters == sum(layers) + sum(widths[1:])
    # Gradient checkpointing recomputes the first block's forward in backward.
    checkpointed = count_step(_mlp(checkpointing=True), TASK, _batch(), None, checkpointing=True)
    assert checkpointed.flops == hand + 2 * B * layers[0]
    # bf16 autocast moves fewer bytes through the matmuls for the same FLOPs.
    half = count_step(_mlp(), TASK, _batch(), torch.bfloat16)
    assert half.flops == hand and half.matmul_bytes < count.matmul_bytes


def test_counting_leaves_the_model_and_rng_untouched() -> None:
    model, batch = _mlp(), _batch()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = torch.random.get_rng_state()
    costs = measure_step_costs(model, TASK, batch, "auto")
    assert costs.as_run.precision == "bf16" and costs.checkpointed is not None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(state, torch.random.get_rng_state())


def _count(flops: float, params: int, activations: float, kernels: int = 50) -> StepCount:
    return StepCount(micro_batch=512, precision="bf16", gradient_checkpointing=False, flops=flops,
                     matmul_bytes=flops / 50, other_bytes=flops / 100, kernels=kernels, parameters=params,
                     parameter_bytes=4 * params, activation_bytes=int(activations), optimizer_bytes=28.0 * params)


def test_the_roofline_follows_the_published_figures() -> None:
    heavy = _count(flops=5e13, params=10_000_000, activations=1e9)
    t4, a100 = (predict_step(heavy, GPUS[g], 1, "auto") for g in ("T4", "A100-40GB"))
    assert t4.precision == "fp16" and a100.precision == "bf16"  # no bf16 on Turing
    assert t4.bound == a100.bound == "compute"
    assert t4.low < t4.mid < t4.high
    # Compute-bound: the middle estimates stand in the ratio of the half-precision peaks.
    assert t4.mid / a100.mid == pytest.approx(312 / 65, rel=0.1)
    tiny = _count(flops=1e6, params=1000, activations=1e5)
    assert predict_step(tiny, GPUS["H100"], 1, "auto").bound == "launch"
    assert peak_flops(GPUS["V100-16GB"], "fp32") == (15.7e12, "fp32")


def _here(seconds_per_step: float = 0.01) -> HereFigures:
    return HereFigures(steps=3600, evals=10, seconds_per_step=seconds_per_step, seconds_per_validation=0.0,
                       seconds_per_checkpoint=1.0, startup_seconds=0.0, data_seconds=0.0,
                       load_seconds_per_batch=None)


def test_a_model_too_large_for_a_t4_is_refused_there_or_planned_with_checkpointing() -> None:
    """As configured the model needs ~18 GB a GPU: it fits an A10G (24 GB) as is; on a T4 (16 GB)
    only with gradient checkpointing (~14 GB), which the row says and prices; with no variant
    small enough the T4 is refused with the reason."""
    params = 3_000_000_000 // 4  # 3 GB of fp32 weights: 12 GB with gradients and AdamW moments
    base = _count(1e12, params, activations=4.5e9)
    costs = StepCosts(as_run=base, bf16=base, checkpointed=base.model_copy(
        update={"activation_bytes": int(0.5e9), "flops": 1.3e12, "gradient_checkpointing": True}))
    config = RetrainConfig()
    rows = {(r.instance_type, r.market): r for r in plan_rows(config, ["g4dn.xlarge", "g5.xlarge"], costs, 512,
                                                              _here(), None)}
    a10g, t4 = rows[("g5.xlarge", "on_demand")], rows[("g4dn.xlarge", "on_demand")]
    assert a10g.fits and a10g.variant == "as configured" and 16 < (a10g.need_gb or 0) < 24
    assert t4.fits and t4.variant == "gradient checkpointing" and t4.set == {"model.gradient_checkpointing": "true"}
    assert (t4.need_gb or 0) < 16

    nothing_fits = StepCosts(as_run=base, bf16=base, checkpointed=None)
    huge = nothing_fits.model_copy(update={"as_run": _count(1e12, 4 * params, 4.5e9)})
    rows_huge = plan_rows(config, ["g4dn.xlarge"], huge.model_copy(update={"bf16": huge.as_run}), 1, _here(), None)
    assert not rows_huge[0].fits and "its GPU has 16 GB" in (rows_huge[0].refused or "")


def test_the_worked_example_a_cheaper_slower_instance_wins_when_the_deadline_allows() -> None:
    """$1.40/h for 2.2 h ($3.08) beats $4.00/h for 1 h ($4.00) when the deadline allows 2.2 h;
    with 1.5 h only the dearer one meets it. Step times as measured on each instance."""
    config = RetrainConfig.model_validate({"cost": {"prices": {
        "small": {"gpus": 1, "on_demand_per_hour": 1.40, "measured_step_seconds": 2.2},
        "big": {"gpus": 1, "on_demand_per_hour": 4.00, "measured_step_seconds": 1.0}}}})
    costs = StepCosts(as_run=_count(1e9, 1000, 1e6), bf16=_count(1e9, 1000, 1e6), checkpointed=None)
    rows = plan_rows(config, ["small", "big"], costs, 512, _here(), 3.0)
    assert [r.instance_type for r in rows] == ["small", "big"]
    assert rows[0].cost_usd[1] == pytest.approx(3.08) and rows[1].cost_usd[1] == pytest.approx(4.00)
    tight = plan_rows(config, ["small", "big"], costs, 512, _here(), 1.5)
    assert tight[0].instance_type == "big" and not tight[1].meets_deadline and tight[1].p_deadline == 0.0


def test_expected_spot_time_uses_young_daly_and_the_published_band() -> None:
    rate = hourly_rates(">20%")[1]
    assert rate == pytest.approx(-math.log(1 - 0.35) / 730)
    assert SPOT_BANDS["us-east-1"]["g4dn.xlarge"] == "15-20%"
    out = spot_outlook(10.0, 0.2, save_seconds=30.0, restart_seconds=120.0, deadline_hours=None)
    tau = young_daly_seconds(30.0, 0.2)
    assert out.checkpoint_every_seconds == pytest.approx(math.sqrt(2 * 30 * 3600 / 0.2)) == tau
    stalled = 10.0 * (1 + 30.0 / tau)
    assert out.hours == pytest.approx(stalled / (1 - 0.2 * (120 + tau / 2) / 3600))
    assert out.interruptions == pytest.approx(0.2 * out.hours)
    # The chance of ending in time grows with the deadline and is 0 below the work itself.
    chances = [spot_outlook(10.0, 0.2, 30.0, 120.0, d).p_deadline for d in (9.0, 11.0, 12.0, 14.0)]
    assert chances[0] == 0.0 and chances == sorted(chances) and (chances[-1] or 0) > 0.9
    on_demand = spot_outlook(10.0, 0.0, 30.0, 120.0, 12.0)
    assert on_demand.hours == 10.0 and on_demand.p_deadline == 1.0


def test_every_shipped_gpu_instance_names_a_sourced_gpu() -> None:
    config = RetrainConfig()
    for name, price in config.cost.prices.items():
        if price.gpus:
            assert price.gpu in GPUS and price.vcpus, name
            assert GPUS[price.gpu].memory_gb == price.gpu_memory_gb, name
    assert all(g.source for g in GPUS.values())
    with pytest.raises(ValueError, match="unknown GPU 'K80'"):
        RetrainConfig.model_validate({"cost": {"prices": {"x": {"gpus": 1, "on_demand_per_hour": 1.0, "gpu": "K80"}}}})


def _task_batch(**columns: torch.Tensor) -> Batch:
    return Batch(num=torch.zeros(B, 0), cat=torch.zeros(B, 0, dtype=torch.int64),
                 label=torch.randint(0, 2, (B,)).float()).replace(**columns)


def test_the_transformers_flops_are_the_hand_count() -> None:
    """Per layer and token: qkv, projection and the 4x MLP are 2·(3 + 1 + 8)·d² FLOPs forward;
    attention 4·t·d per token (scores and the weighted sum); backward twice the forward
    throughout (every input needs its gradient). Then the MLP head on the pooled d."""
    t, d, heads, layers = 16, 32, 4, 2
    config = RetrainConfig().model.model_copy(update={
        "numeric_embedding": "none", "hidden": [8], "text_dim": d, "text_layers": layers, "text_heads": heads,
        "dropout": 0.0, "attention": "flash"})  # counted as math whatever the configured kernel
    schema = ModelSchema(task="binary", n_outputs=1, numeric=[], categorical=[], cardinalities=[], text=["t"],
                         vocab_size=50, max_tokens=t)
    batch = _task_batch(tok=torch.randint(1, 50, (B, 1, t)), ntok=torch.full((B, 1), t))
    tokens = B * t
    encoder = 3 * layers * (24 * tokens * d * d + 4 * B * t * t * d)
    head = 3 * 2 * B * d * 8 + 3 * 2 * B * 8
    assert count_step(build_model(config, schema), TASK, batch, None).flops == encoder + head


def test_the_cnns_flops_are_the_hand_count() -> None:
    """A 3x3 convolution is 2·H·W·Cin·Cout·9 FLOPs forward, as much again for its weight gradient
    and, past the first (whose pixels need no gradient), for its input gradient."""
    config = RetrainConfig().model.model_copy(update={"numeric_embedding": "none", "hidden": [8],
                                                      "image_channels": [4, 8], "dropout": 0.0})
    schema = ModelSchema(task="binary", n_outputs=1, numeric=[], categorical=[], cardinalities=[], image=["i"],
                         image_size=8, image_mean=[1.0] * 3, image_std=[1.0] * 3)
    batch = _task_batch(pix=torch.randint(0, 255, (B, 1, 3, 8, 8), dtype=torch.uint8))
    conv1, conv2 = 2 * B * 8 * 8 * 3 * 4 * 9, 2 * B * 4 * 4 * 4 * 8 * 9  # pooled 2x between them
    head = 3 * 2 * B * 8 * 8 + 3 * 2 * B * 8
    assert count_step(build_model(config, schema), TASK, batch, None).flops == 2 * conv1 + 3 * conv2 + head


def _wide_mlp(rows: int, width: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    config = RetrainConfig().model.model_copy(update={"numeric_embedding": "none", "hidden": [width] * 3,
                                                      "dropout": 0.0})
    schema = ModelSchema(task="binary", n_outputs=1, numeric=[f"x{i}" for i in range(64)], categorical=[],
                         cardinalities=[])
    batch = Batch(num=torch.randn(rows, 64), cat=torch.zeros(rows, 0, dtype=torch.int64),
                  label=torch.randint(0, 2, (rows,)).float())
    return build_model(config, schema), batch


def peak_step_bytes(rows: int, width: int) -> int:
    """Measured: what a steady-state training step holds at its peak, from the process's peak
    resident set (run in a fresh process). The first step allocates AdamW's moments; the second
    is measured from the resident weights and moments to its peak."""
    from pathlib import Path

    torch.set_num_threads(1)
    model, batch = _wide_mlp(rows, width)
    optimizer = torch.optim.AdamW(model.parameters())
    forward = forward_fn(model)
    for step in range(2):
        if step == 1:
            resident = int(Path("/proc/self/statm").read_text().split()[1]) * 4096
            Path("/proc/self/clear_refs").write_text("5")  # restart the peak (VmHWM) from here
        TASK.forward_loss(forward, batch, torch.device("cpu"), None).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    status = Path("/proc/self/status").read_text().splitlines()
    peak = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))
    weights_and_moments = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    return peak - resident + weights_and_moments


@pytest.mark.parametrize(("rows", "width"), [(16384, 1024), (512, 4096)], ids=["activations", "weights"])
def test_the_memory_estimate_matches_a_measured_cpu_step(rows: int, width: int) -> None:
    """The estimate a GPU is checked against (weights, gradients, AdamW moments, the step's
    transient tensors; the CUDA allowance aside) within 15 % of a real step's peak, for a model
    whose memory is mostly activations and one whose memory is mostly weights."""
    import subprocess
    import sys
    from pathlib import Path

    from training.cost.roofline import CUDA_OVERHEAD_BYTES, training_bytes

    model, batch = _wide_mlp(rows, width)
    estimate = training_bytes(count_step(model, TASK, batch, None), 1) - CUDA_OVERHEAD_BYTES
    code = f"from tests.training.cost.test_plan import peak_step_bytes; print(peak_step_bytes({rows}, {width}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[3])
    measured = int(out.stdout.strip())
    assert estimate == pytest.approx(measured, rel=0.15), (estimate / 1e6, measured / 1e6)


def test_runs_measured_on_gpus_calibrate_their_familys_predictions() -> None:
    """Two runs measured at 2x and 3x their predictions scale every GPU's prediction for the
    family by the median (2.5x), the range by the spread; a run of this very step on an instance
    type is used as is there."""
    from training.cost.planner import Calibrated
    from training.registry.step_times import StepTime, StepTimeBook

    count = _count(flops=5e13, params=10_000_000, activations=1e9)
    costs = StepCosts(as_run=count, bf16=count, checkpointed=None)
    config = RetrainConfig()
    plain = {r.instance_type: r for r in plan_rows(config, ["g5.xlarge", "p3.2xlarge"], costs, 512, _here(), None)
             if r.market == "on_demand"}
    a10g = plain["g5.xlarge"].step_seconds
    assert a10g is not None

    def record(instance: str, ratio: float, signature: str = "other") -> StepTime:
        mid = plain[instance].step_seconds[1]  # type: ignore[index]
        return StepTime(instance_type=instance, gpu="x", device="cuda", family="tabular", signature=signature,
                        actual_seconds=ratio * mid, predicted_seconds=(mid, mid, mid), recorded=True)

    book = StepTimeBook(records=[record("g5.xlarge", 2.0), record("p3.2xlarge", 3.0),
                                 record("p3.2xlarge", 9.0, signature="mine"),
                                 record("g5.xlarge", 50.0).model_copy(update={"family": "text"}),
                                 record("g5.xlarge", 50.0).model_copy(update={"recorded": False})])
    calibrated = book.calibration("tabular", "mine")
    assert calibrated.runs == 3 and calibrated.factor == pytest.approx(3.0)
    assert calibrated.measured == {"p3.2xlarge": pytest.approx(9.0 * plain["p3.2xlarge"].step_seconds[1])}
    calibrated = Calibrated(runs=2, factor=2.5, factor_range=(2.0, 3.0))
    scaled = {r.instance_type: r for r in plan_rows(config, ["g5.xlarge"], costs, 512, _here(), None, calibrated)}
    step = scaled["g5.xlarge"].step_seconds
    assert step == pytest.approx((a10g[0] * 2.0, a10g[1] * 2.5, a10g[2] * 3.0))
    assert "x2.5 from 2 measured run(s)" in scaled["g5.xlarge"].step_source


def test_a_real_transformer_that_fits_only_with_gradient_checkpointing_is_planned_so() -> None:
    """Counted on the built-in text model: checkpointing each block keeps less for backward.
    On a GPU with room between the two needs, the plan picks the checkpointed variant and names
    its key; on one smaller than both, every variant is refused."""
    from training.cost.roofline import training_bytes

    config = RetrainConfig().model.model_copy(update={"numeric_embedding": "none", "hidden": [8], "text_dim": 32,
                                                      "text_layers": 2, "text_heads": 4, "dropout": 0.0})
    schema = ModelSchema(task="binary", n_outputs=1, numeric=[], categorical=[], cardinalities=[], text=["t"],
                         vocab_size=100, max_tokens=32)
    batch = _task_batch(tok=torch.randint(1, 100, (B, 1, 32)), ntok=torch.full((B, 1), 32))
    costs = measure_step_costs(build_model(config, schema), TASK, batch, "fp32")
    assert costs.checkpointed is not None
    plain, checkpointed = training_bytes(costs.as_run, 1), training_bytes(costs.checkpointed, 1)
    assert checkpointed < plain
    between = (plain + checkpointed) / 2 / 1e9
    retrain = RetrainConfig.model_validate({"train": {"precision": "fp32", "batch_size": B}, "cost": {"prices": {
        "roomy": {"gpus": 1, "gpu": "T4", "gpu_memory_gb": between, "on_demand_per_hour": 1.0},
        "small": {"gpus": 1, "gpu": "T4", "gpu_memory_gb": checkpointed / 1e9 / 2, "on_demand_per_hour": 0.5}}}})
    # bf16 would also halve the activations: with fp32 configured the plan tries it first, so
    # offer only what is being tested here.
    only = costs.model_copy(update={"bf16": costs.as_run})
    rows = {r.instance_type: r for r in plan_rows(retrain, ["roomy", "small"], only, B, _here(), None)}
    assert rows["roomy"].fits and rows["roomy"].set.get("model.gradient_checkpointing") == "true"
    assert rows["roomy"].variant == "gradient checkpointing"
    assert not rows["small"].fits and "in any variant" in (rows["small"].refused or "")


def test_an_auto_run_takes_the_planned_instance_and_its_memory_variant(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from training.cost.planner import PlanRow
    from training.errors import ConfigError
    from training.registry.step_times import resolve_planned_instance, store_choice

    config = RetrainConfig.model_validate({"storage": {"root": str(tmp_path)}, "cost": {"instance_type": "auto"}})
    with pytest.raises(ConfigError, match="run `retrain plan` with this storage.root first"):
        resolve_planned_instance(config)
    pick = PlanRow(instance_type="g4dn.xlarge", market="spot", rate_per_hour=0.19, variant="micro-batch 256 x 2",
                   set={"model.gradient_checkpointing": "true", "train.batch_size": "256", "train.grad_accum": "2"})
    store_choice(config, pick)
    run = resolve_planned_instance(config)
    assert (run.cost.instance_type, run.cost.market) == ("g4dn.xlarge", "spot")
    assert run.model.gradient_checkpointing is True and (run.train.batch_size, run.train.grad_accum) == (256, 2)
    assert run.cost.rate() == (0.1869, 1)
    (tmp_path / "plan" / "choice.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a readable plan choice"):
        resolve_planned_instance(config)


@pytest.mark.parametrize("planted", [
    {"set": {"storage.root": "/elsewhere"}},
    {"set": {"data.source": "/other/data"}},
    {"set": {"model.factory": "builtins:print"}},
    {"set": {"nonexistent.key": "1"}},
    {"set": {"train.max_steps=1 --set storage.root": "/tmp"}},
    {"set": {"train.max_steps.x": "1"}},
    {"set": {"train.batch_size": "many"}},
    {"set": {"train.grad_accum": "100000000"}},
    {"set": {"train.batch_size": "8", "train.grad_accum": "2"}},
    {"set": {"train.batch_size": "1", "train.grad_accum": "512"}},
    # Decimal strings parse as the config's integers, but a plan writes digits: "8.0" would skip
    # the bound and train an 8x larger effective batch, "1e8" reopen the hang the bound is for.
    {"set": {"train.grad_accum": "8.0"}},
    {"set": {"train.grad_accum": "100000000.0"}},
    {"set": {"train.batch_size": "1024.0"}},
    {"set": {"train.grad_accum": "1e8"}},
    {"set": {"train.grad_accum": " 2"}},
    {"set": {"train.grad_accum": "+2"}},
    {"set": {"model.gradient_checkpointing": "1"}},
    {"set": {"train.precision": "int8"}},
    {"instance_type": "auto"},
    {"instance_type": "no-such-instance"},
    {"market": "free"},
    {"extra": "key"},
], ids=lambda planted: ",".join(f"{k}={v}" for k, v in planted.items()))
def test_a_stored_plan_choice_sets_only_what_a_plan_decides(tmp_path, planted) -> None:  # type: ignore[no-untyped-def]
    """plan/choice.json is input from whoever can write the root: a key outside the plan's own
    (instance, market, memory variant) or a value of the wrong type is one ConfigError naming the
    file, never a rewritten run."""
    from training.errors import ConfigError
    from training.registry.step_times import resolve_planned_instance

    config = RetrainConfig.model_validate({"storage": {"root": str(tmp_path)}, "cost": {"instance_type": "auto"}})
    choice = {"instance_type": "local-cpu", "market": "on_demand", "set": {}, "planned_at": 0.0, **planted}
    (tmp_path / "plan").mkdir()
    (tmp_path / "plan" / "choice.json").write_text(json.dumps(choice))
    with pytest.raises(ConfigError, match="plan/choice.json"):
        resolve_planned_instance(config)


@pytest.mark.parametrize(("planted", "named"), [({"extra": "key"}, "extra"), ({"set": {"train.batch_size": 64}}, "set.train.batch_size"),
                                               ({"market": None}, "market")])
def test_a_plan_choice_that_breaks_its_schema_names_the_key(tmp_path, planted, named) -> None:  # type: ignore[no-untyped-def]
    from training.errors import ConfigError
    from training.registry.step_times import resolve_planned_instance

    config = RetrainConfig.model_validate({"storage": {"root": str(tmp_path)}, "cost": {"instance_type": "auto"}})
    choice = {"instance_type": "local-cpu", "market": "on_demand", "set": {}, "planned_at": 0.0, **planted}
    (tmp_path / "plan").mkdir()
    (tmp_path / "plan" / "choice.json").write_text(json.dumps(choice))
    with pytest.raises(ConfigError, match=rf"plan/choice.json: {named}: "):
        resolve_planned_instance(config)


def test_a_directory_at_the_plan_choice_is_one_config_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from training.errors import ConfigError
    from training.registry.step_times import resolve_planned_instance

    config = RetrainConfig.model_validate({"storage": {"root": str(tmp_path)}, "cost": {"instance_type": "auto"}})
    (tmp_path / "plan" / "choice.json").mkdir(parents=True)
    with pytest.raises(ConfigError, match="not a readable plan choice"):
        resolve_planned_instance(config)


def test_step_times_that_are_not_positive_and_finite_are_left_out_with_a_warning(
        tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    import logging

    from training.registry.step_times import BOOK, StepTime, StepTimeBook
    from training.storage.root import StorageRoot

    config = RetrainConfig.model_validate({"storage": {"root": str(tmp_path)}})
    root = StorageRoot.from_config(config)

    def record(seconds: float) -> dict:
        return StepTime(instance_type="g5.xlarge", gpu="A10G", device="cuda", family="tabular", signature="s",
                        actual_seconds=seconds, predicted_seconds=(0.1, 0.2, 0.3), recorded=True).model_dump()

    (tmp_path / "plan").mkdir()
    records = [record(0.25), record(-5.0), record(float("nan")), record(float("inf")), record(1e308)]
    (tmp_path / BOOK).write_text(json.dumps({"records": records}))
    with caplog.at_level(logging.WARNING):
        book = StepTimeBook.load(root)
    assert [r.actual_seconds for r in book.records] == [0.25]
    assert "left out 4 records" in caplog.text and "-5.0" in caplog.text


def test_a_directory_at_the_step_time_book_loses_calibration_not_the_run(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    import logging

    from training.registry.step_times import BOOK, StepTime, StepTimeBook
    from training.storage.root import StorageRoot

    root = StorageRoot.from_config(RetrainConfig.model_validate({"storage": {"root": str(tmp_path)}}))
    (tmp_path / BOOK).mkdir(parents=True)
    with caplog.at_level(logging.WARNING):
        book = StepTimeBook.load(root)
        book.add(root, StepTime(instance_type="local-cpu", gpu=None, device="cpu", family="tabular", signature="s",
                                actual_seconds=0.01))
    assert book.records and "unreadable" in caplog.text and "cannot write" in caplog.text


def test_a_cpu_instances_step_is_this_machines_carried_to_its_cores_by_the_measured_share() -> None:
    from training.cost.cpu_step import CpuScaling, cores_for_training, predict_cpu_step

    # 2.0 s at one thread, 1.2 s at two: a parallel share of 0.8 (Amdahl).
    scaling = CpuScaling(threads=2, compare_threads=2, one_thread_seconds=2.0, compare_seconds=1.2)
    assert cores_for_training(2) == 1 and cores_for_training(8) == 3 and cores_for_training(32) == 15
    step = predict_cpu_step(1.2, scaling, vcpus=8, relative_speed=1.0)
    assert step.measured_share and step.share == pytest.approx(0.8)
    assert step.mid == pytest.approx(2.0 * (0.2 + 0.8 / 3))
    assert step.low < step.mid < step.high
    one_core = predict_cpu_step(1.2, scaling, vcpus=2, relative_speed=1.0)
    assert one_core.mid == pytest.approx(2.0) and one_core.low < 2.0 < one_core.high
    assert predict_cpu_step(1.2, scaling, vcpus=8, relative_speed=2.0).mid == pytest.approx(step.mid / 2)
    prior = predict_cpu_step(1.2, None, vcpus=8, relative_speed=1.0)
    assert not prior.measured_share and prior.share == 0.5


def test_a_cpu_instances_step_comes_from_cpu_time_whatever_the_load_here() -> None:
    """A busy machine slows the wall clock, not the work: the same step measured quiet and under
    load (every wall time tripled, the one-thread CPU time the same) predicts the same instance
    step, and so the same pick."""
    from training.cost.cpu_step import CpuScaling, predict_cpu_step

    quiet = CpuScaling(threads=2, compare_threads=2, one_thread_seconds=0.0040, compare_seconds=0.0032,
                       one_thread_cpu_seconds=0.0038)
    busy = quiet.model_copy(update={"one_thread_seconds": 0.0120, "compare_seconds": 0.0096})
    for vcpus in (2, 8, 32):
        a = predict_cpu_step(0.0040, quiet, vcpus, 1.0)
        b = predict_cpu_step(0.0120 * 2, busy, vcpus, 1.0)  # the loop's wall step here, also slowed
        assert (a.low, a.mid, a.high) == pytest.approx((b.low, b.mid, b.high)) and a.from_cpu_time
    assert predict_cpu_step(0.004, quiet, 2, 1.0, micro_batches=4).mid == pytest.approx(4 * 0.0038)


def test_the_scaling_probe_times_the_step_on_the_clocks_it_is_given() -> None:
    """CPU time from the CPU clock, the share from the wall clock: a fake wall clock that runs
    three times fast (a load of two more processes per core) leaves the CPU figure and the
    share where they are."""
    from training.trainer.step_cost import measure_cpu_scaling

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    task = BinaryTask(FeatureStats([], [], [], [], []))
    batch = Batch(num=torch.randn(32, 8), cat=torch.zeros(32, 0, dtype=torch.int64), label=torch.ones(32))

    def forward_of(m: torch.nn.Module):  # type: ignore[no-untyped-def]
        return lambda b: m(b.num).squeeze(-1)

    import training.trainer.step_cost as step_cost

    original = step_cost.forward_fn
    step_cost.forward_fn = lambda module, like=None: forward_of(module)  # type: ignore[assignment]
    try:
        ticks = {"cpu": 0.0, "wall": 0.0, "threads": 1}

        def cpu() -> float:  # one "millisecond" of CPU a reading, at any thread count
            ticks["cpu"] += 1e-3
            return ticks["cpu"]

        def wall(factor: float) -> float:
            ticks["wall"] += factor * 1e-3 / torch.get_num_threads() ** 0.5
            return ticks["wall"]

        calm = measure_cpu_scaling(model, task, batch, 2, 2.0, wall=lambda: wall(1.0), cpu=cpu)
        loaded = measure_cpu_scaling(model, task, batch, 2, 2.0, wall=lambda: wall(3.0), cpu=cpu)
    finally:
        step_cost.forward_fn = original  # type: ignore[assignment]
    assert calm.one_thread_cpu_seconds == pytest.approx(loaded.one_thread_cpu_seconds)
    from training.cost.cpu_step import parallel_share

    assert parallel_share(calm) == pytest.approx(parallel_share(loaded))


def test_this_machine_is_shown_but_never_recommended_for_renting() -> None:
    from training.cost.planner import THIS_MACHINE, recommended

    config = RetrainConfig()
    small = _count(1.2e8, 50_000, 2e6)
    rows = plan_rows(config, ["local-cpu", "c6i.large"], StepCosts(as_run=small, bf16=small, checkpointed=None), 512,
                     _here(0.004), None)
    mine = [r for r in rows if r.instance_type == "local-cpu"]
    assert [r.market for r in mine] == [THIS_MACHINE] and mine[0].here and rows[-1] is mine[0]  # no spot row
    best = recommended(rows)
    assert best is not None and best.instance_type == "c6i.large"
    assert recommended(mine) is None


def test_the_plan_table_fits_in_100_characters_unless_asked_wide() -> None:
    from retrain_cli.main import plan_table
    from training.cost.planner import PlanRow

    rows = [PlanRow(instance_type="Standard_NC4as_T4_v3", market="on_demand", rate_per_hour=0.526,
                    step_seconds=(0.0012, 0.0023, 0.004), hours=(0.1, 0.2, 0.3), cost_usd=(0.05, 0.1, 0.2),
                    step_source="predicted: T4 fp16, launch-bound, x1.2 from 3 measured run(s)", interruptions=0.5,
                    lost_hours=0.1, interruption_band="15-20%"),
            PlanRow(instance_type="tiny", market="spot", rate_per_hour=0.01, fits=False,
                    refused="training needs about 30.0 GB a GPU as configured and at least 20 GB in any variant")]
    assert max(len(line) for line in plan_table(rows)) <= 100
    assert max(len(line) for line in plan_table(rows, wide=True)) > 100


def test_plan_picks_a_cloud_cpu_for_a_small_model_and_a_gpu_for_a_heavy_one() -> None:
    """The shipped table's CPU types against its GPUs: a small tabular step that a core runs in
    milliseconds is cheapest on a c6i; a step that takes a core seconds but a GPU milliseconds
    is cheapest on a GPU."""
    from training.config.prices import DEFAULT_PRICES
    from training.cost.cpu_step import CpuScaling

    config = RetrainConfig()
    names = [n for n in DEFAULT_PRICES if n != "local-cpu"]
    scaling = CpuScaling(threads=2, compare_threads=2, one_thread_seconds=0.006, compare_seconds=0.004)
    small = _count(1.2e8, 50_000, 2e6).model_copy(update={"kernels": 77})
    here = _here(0.004).model_copy(update={"steps": 2000, "cpu_scaling": scaling})
    rows = plan_rows(config, names, StepCosts(as_run=small, bf16=small, checkpointed=None), 512, here, None)
    assert rows[0].instance_type.startswith("c6i.") and "core(s)" in rows[0].step_source

    heavy = _count(5e12, 20_000_000, 2e9).model_copy(update={"kernels": 250})
    slow_here = _here(3.0).model_copy(update={"steps": 2000, "cpu_scaling": scaling})
    rows = plan_rows(config, names, StepCosts(as_run=heavy, bf16=heavy, checkpointed=None), 256, slow_here, None)
    assert DEFAULT_PRICES[rows[0].instance_type].get("gpu"), rows[0]


def test_a_cpu_instance_too_small_for_the_model_is_refused() -> None:
    config = RetrainConfig()
    big = _count(1e9, 1_500_000_000 // 4, 1e9)  # 6 GB of weights, gradients and moments
    rows = plan_rows(config, ["c6i.large", "c6i.2xlarge"], StepCosts(as_run=big, bf16=big, checkpointed=None), 512,
                     _here(), None)
    refused = {r.instance_type: r for r in rows if not r.fits}
    assert set(refused) == {"c6i.large"} and "its memory has 4.29 GB" in (refused["c6i.large"].refused or "")


def test_auto_precision_is_priced_both_ways_and_the_faster_kept() -> None:
    """A launch-bound step runs faster without autocast's casts (fewer kernels): the plan keeps
    fp32 and sets it. A compute-bound step runs faster on the half-precision tensor cores."""
    config = RetrainConfig.model_validate({"train": {"precision": "auto"}})
    tiny_half, tiny_full = _count(1.2e8, 50_000, 2e6, kernels=77), _count(1.2e8, 50_000, 2e6, kernels=57)
    rows = plan_rows(config, ["g5.xlarge"], StepCosts(as_run=tiny_half, bf16=tiny_half, checkpointed=None,
                                                      fp32=tiny_full), 512, _here(), None)
    assert {r.variant for r in rows} == {"fp32"} and rows[0].set == {"train.precision": "fp32"}
    heavy_half = _count(5e13, 10_000_000, 1e9, kernels=250)
    heavy_full = heavy_half.model_copy(update={"precision": "fp32", "kernels": 200})
    rows = plan_rows(config, ["g5.xlarge"], StepCosts(as_run=heavy_half, bf16=heavy_half, checkpointed=None,
                                                      fp32=heavy_full), 512, _here(), None)
    assert {r.variant for r in rows} == {"as configured"}


def test_an_eager_step_takes_the_longer_of_launches_and_gpu_work_but_fp16_adds_them() -> None:
    count = _count(2e11, 1_000_000, 1e8, kernels=100)
    bf16 = predict_step(count, GPUS["A10G"], 1, "bf16")
    fp16 = predict_step(count, GPUS["A10G"], 1, "fp16")
    launch = 100 * 40e-6
    assert bf16.mid > launch  # the GPU's work is the longer: the launches hide behind it
    assert fp16.mid == pytest.approx(bf16.mid + launch)  # the scaler's read-back serialises them
