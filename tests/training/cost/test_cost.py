"""Cost arithmetic against hand-computed cases."""

from __future__ import annotations

import pytest

from training.config import load_config
from training.cost.bill import compute_cost, naive_counterfactual, restarting_counterfactual, storage_cost
from training.errors import ConfigError


def test_compute_cost_is_rate_times_time_per_stage() -> None:
    out = compute_cost({"pack": 360.0, "train": 3240.0}, rate_per_hour=9.83, gpus=8)
    assert out.billed_seconds == 3600.0
    assert out.usd == pytest.approx(9.83)
    assert out.gpu_hours == pytest.approx(8.0)
    assert out.per_stage_usd == {"pack": pytest.approx(0.983), "train": pytest.approx(8.847)}


def test_preemption_inflated_cost() -> None:
    # 2 h of useful training, 3 preemptions each losing 6 min of work plus a 2 min restart:
    # billed 2 h + 3 x 8 min = 2.4 h at $9.83/h = $23.592.
    seconds = {"train": 2 * 3600.0, "lost": 3 * 360.0, "restarts": 3 * 120.0}
    assert compute_cost(seconds, 9.83, 8).usd == pytest.approx(23.592)


def test_storage_cost_for_the_retention() -> None:
    out = storage_cost(
        {"shards": 50_000_000_000, "checkpoints": 10_000_000_000, "models": 0},
        {"shards": "STANDARD", "checkpoints": "STANDARD_IA", "models": "STANDARD"},
        {"STANDARD": 0.023, "STANDARD_IA": 0.0125},
        {"shards": 30.0, "checkpoints": 7.0, "models": 365.0},
    )
    assert out.shards.usd == pytest.approx(50 * 0.023)  # 50 GB for one month
    assert out.checkpoints.usd == pytest.approx(10 * 0.0125 * 7 / 30)
    assert out.total_usd == pytest.approx(1.15 + 0.0291666667)


def test_naive_counterfactual() -> None:
    # 600 s of other stages, 0.5 s/step measured in bf16, fp32 measured 2x slower, 10,000 steps
    # without early stopping: 600 + 10,000 s = 10,600 s at the on-demand $32.77/h.
    out = naive_counterfactual(other_stage_seconds=600, train_seconds_per_step=0.5, naive_steps=10_000,
                               fp32_slowdown=2.0, on_demand_per_hour=32.77, gpus=8)
    assert out.seconds == 10_600
    assert out.usd == pytest.approx(32.77 * 10_600 / 3600)
    assert out.gpu_hours == pytest.approx(8 * 10_600 / 3600)


def test_the_restarting_counterfactual_redoes_everything_before_each_preemption() -> None:
    # Preempted at steps 3,000 and 8,000 of 10,000: without checkpoints those 11,000 steps are
    # done again (at 0.5 s x 2.0 fp32), plus a 60 s restart each, at this run's $10/h.
    naive = naive_counterfactual(other_stage_seconds=600, train_seconds_per_step=0.5, naive_steps=10_000,
                                 fp32_slowdown=2.0, on_demand_per_hour=32.77, gpus=8)
    out = restarting_counterfactual(naive=naive, steps_reached_at_preemptions=[3_000, 8_000],
                                    train_seconds_per_step=0.5, restart_seconds=60.0, rate_per_hour=10.0, gpus=8)
    assert out.steps_redone == 11_000
    assert out.seconds == 10_600 + 11_000 + 120
    assert out.usd == pytest.approx(10.0 * 21_720 / 3600)
    none = restarting_counterfactual(naive=naive, steps_reached_at_preemptions=[], train_seconds_per_step=0.5,
                                     restart_seconds=60.0, rate_per_hour=10.0, gpus=8)
    assert none.seconds == naive.seconds  # never preempted: the same job at this run's rate


def test_price_table_entries_merge_and_are_validated(tmp_path) -> None:
    import yaml

    config = load_config(overrides=["cost.instance_type=p4d.24xlarge", "cost.market=spot"])
    assert config.cost.rate() == (6.7915, 8)
    with pytest.raises(ConfigError, match="no entry in cost.prices"):
        load_config(overrides=["cost.instance_type=nope"])
    mine = {"cost": {"instance_type": "my-a100", "market": "spot",
                     "prices": {"my-a100": {"gpus": 1, "on_demand_per_hour": 3.0}}}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(mine))
    with pytest.raises(ConfigError, match="spot_per_hour is empty"):
        load_config(path)
    # A user entry is merged over the shipped table, which keeps its other entries.
    mine["cost"]["market"] = "on_demand"
    path.write_text(yaml.safe_dump(mine))
    config = load_config(path)
    assert config.cost.rate() == (3.0, 1) and "p5.48xlarge" in config.cost.prices


def test_shipped_price_table_is_sourced_and_sane() -> None:
    from training.config.prices import DEFAULT_PRICES, PRICE_SOURCE

    assert "skypilot-catalog" in PRICE_SOURCE and "2026" in PRICE_SOURCE
    for name, entry in DEFAULT_PRICES.items():
        if name == "local-cpu":
            continue
        # Spot below on-demand; a GPU count for every GPU instance, vCPUs and memory for every CPU one.
        assert 0 < entry["spot_per_hour"] < entry["on_demand_per_hour"], name
        assert entry["gpus"] >= 1 if entry.get("gpu") else (entry["vcpus"] >= 2 and entry["memory_gb"] > 0), name
    # GCP entries are host + GPUs (the catalog's two rows), not the host alone ($0.74/h).
    assert DEFAULT_PRICES["a2-highgpu-1g"]["on_demand_per_hour"] == pytest.approx(0.73948 + 2.93391)
    assert DEFAULT_PRICES["a2-highgpu-8g"]["gpus"] == 8


def test_a_cost_on_a_declared_instance_says_what_the_run_ran_on() -> None:
    from training.config import RetrainConfig
    from training.pipeline.report_stage import _declared_on

    gpu = RetrainConfig.model_validate({"cost": {"instance_type": "g4dn.xlarge", "market": "spot"}})
    assert _declared_on(gpu, "cpu") == "the CPU" and _declared_on(gpu, "cuda") is None
    assert _declared_on(RetrainConfig(), "cpu") is None  # local-cpu on the CPU
    assert _declared_on(RetrainConfig.model_validate({"cost": {"instance_type": "c6i.large"}}), "cuda") == "a CUDA GPU"


def test_a_saving_is_never_shown_as_a_negative_zero() -> None:
    """An on-demand run's saving against the naive on-demand run is 0 up to float rounding: the
    demo's summary once read "saved $-0.0000"."""
    from training.pipeline.reports.markdown import savings

    assert savings(-3e-9, "it") == "cost the same as it"
    assert savings(-6.66e-06, "it") == "cost $0.0000067 more than it"  # never "$6.7e-06"
    assert savings(1e-05, "it") == "saved $0.000010 against it"
    assert savings(0.01234, "it") == "saved $0.0123 against it"
    assert savings(-2.5, "it") == "cost $2.50 more than it"
