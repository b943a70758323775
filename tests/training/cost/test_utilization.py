from __future__ import annotations

from training.cost.utilization import AcceleratorStats, utilization_summary

# train, data_wait, compute, checkpoint, eval seconds
_BUSY = (10.0, 0.1, 9.0, 0.2, 0.5)
_STARVED = (10.0, 6.0, 3.0, 0.2, 0.5)


def test_the_verdict_is_worded_for_the_device_used() -> None:
    cpu = utilization_summary(*_BUSY, 1000, AcceleratorStats(), "cpu")
    assert cpu.verdict == "compute-bound"
    assert "accelerator" not in cpu.advice and "CPU" in cpu.advice
    gpu = utilization_summary(*_BUSY, 1000, AcceleratorStats(memory_peak_fraction=0.5), "cuda")
    assert gpu.verdict == "compute-bound" and "train.compile" in gpu.advice and "busy" not in gpu.advice
    starved = utilization_summary(*_STARVED, 1000, AcceleratorStats(), "cpu")
    assert starved.verdict == "data-bound" and starved.advice.startswith("the CPU waits for data")
    assert "pin memory" not in starved.advice
    assert starved.seconds.data_wait == 6.0 and abs(sum(v for _, v in starved.fractions.items()) - 1.0) < 1e-9


def test_a_model_that_steps_faster_in_fp32_is_told_so() -> None:
    """On a GPU a small model's autocast casts can cost more than bf16 saves (the GPU check's MLP)."""
    slower = utilization_summary(*_BUSY, 1000, AcceleratorStats(), "cuda", "bf16", fp32_slowdown=0.88)
    assert "0.88x" in slower.advice and "train.precision: fp32" in slower.advice
    faster = utilization_summary(*_BUSY, 1000, AcceleratorStats(), "cuda", "bf16", fp32_slowdown=3.6)
    fp32 = utilization_summary(*_BUSY, 1000, AcceleratorStats(), "cuda", "fp32")
    assert "train.precision" not in faster.advice and "train.precision" not in fp32.advice


def test_an_unmeasured_fp32_step_gives_no_precision_advice_and_prices_the_naive_run_at_this_runs_step() -> None:
    from training.cost.bill import naive_counterfactual

    quiet = utilization_summary(*_BUSY, 1000, AcceleratorStats(), "cuda", "bf16", fp32_slowdown=None)
    assert "fp32" not in quiet.advice
    naive = naive_counterfactual(other_stage_seconds=10.0, train_seconds_per_step=0.5, naive_steps=100,
                                 fp32_slowdown=None, on_demand_per_hour=3.6, gpus=1)
    assert naive.seconds == 60.0 and naive.fp32_slowdown is None
