"""Start-up probes: workers from the measured stall, the micro-batch from (simulated) memory,
torch.compile, and worker memory across epochs."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from tests.training.helpers import make_job
from training.data.batch import Batch
from training.config import RetrainConfig
from training.trainer.run import train
from training.trainer.trainer import Trainer
from training.data.prepare.features import FeatureStats
from training.model.network import TabularMLP
from training.model.objectives import BinaryTask
from training.trainer.throughput import (choose_num_workers, data_and_compute_seconds, find_micro_batch,
                                         step_memory_bytes, workers_for)

CPU = torch.device("cpu")
BINARY = BinaryTask(FeatureStats([], [], [], [], []))


def _model() -> TabularMLP:
    return TabularMLP(6, [41, 4, 61, 301], [32, 16])


def _batch(n: int = 64) -> Batch:
    return Batch(num=torch.randn(n, 6), cat=torch.zeros(n, 4, dtype=torch.long), label=torch.zeros(n))


def test_workers_follow_the_stall() -> None:
    """The decision, on given seconds per batch (the timing itself is measured below)."""
    asked: list[int] = []

    def workers_fast(k: int) -> float:
        asked.append(k)
        return 0.0

    fast = workers_for(t_data=0.00002, t_compute=0.003, spare_cpus=3, worker_seconds=workers_fast)
    assert fast.num_workers == 0 and fast.stall_without_workers < 0.01
    assert asked == []  # no stall: workers are not even tried
    starved = workers_for(t_data=0.02, t_compute=0.003, spare_cpus=3, worker_seconds=workers_fast)
    assert starved.stall_without_workers > 0.8 and starved.num_workers == 3 and asked == [3]  # capped by spare cores
    roomy = workers_for(t_data=0.02, t_compute=0.003, spare_cpus=32, worker_seconds=workers_fast)
    assert roomy.num_workers == 7  # ceil(0.02 / 0.003): each worker has a step of compute to fill
    none_spare = workers_for(t_data=0.02, t_compute=0.003, spare_cpus=0, worker_seconds=workers_fast)
    assert none_spare.num_workers == 0 and none_spare.worker_seconds_per_batch is None


def test_auto_never_picks_workers_slower_than_in_process_loading() -> None:
    """Even when loading stalls the step, workers that deliver batches more slowly than the
    in-process path (as the per-batch hand-off did, 28x slower) are measured and refused."""
    probe = workers_for(t_data=0.02, t_compute=0.003, spare_cpus=3, worker_seconds=lambda k: 0.5)
    assert probe.stall_without_workers > 0.5 and probe.num_workers == 0 and probe.worker_seconds_per_batch == 0.5


def test_the_probe_times_loading_and_the_step() -> None:
    """Lower bounds only: a fetch that sleeps 20 ms takes at least that long, on any load."""
    ready = _batch()

    def slow(i: int):
        time.sleep(0.02)
        return ready

    t_data, t_compute = data_and_compute_seconds(_model(), BINARY, slow, CPU, None)
    assert t_data >= 0.02 and t_compute > 0
    probe = choose_num_workers(_model(), BINARY, slow, CPU, None, lambda k: 0.0)
    spare = max(0, len(os.sched_getaffinity(0)) - torch.get_num_threads())  # cores the CPU step leaves idle
    assert probe.spare_cpus == spare and probe.data_seconds_per_batch >= 0.02


def test_the_worker_probe_measures_real_workers(small_config: RetrainConfig) -> None:
    from training.data.prepare.features import FeatureStats
    from training.data.load.loader import ShardBatches, worker_seconds_per_batch
    from training.data.manifest import load_manifest

    job = make_job(small_config)
    stats = FeatureStats.from_json(Path(job.stats_path).read_text())
    batches = ShardBatches(Path(job.dataset_dir), load_manifest(Path(job.dataset_dir)), "train", 16, stats.transformer())
    assert 0 < worker_seconds_per_batch(batches, 1) < 1


def test_probes_leave_the_run_rng_untouched() -> None:
    model = TabularMLP(6, [41, 4, 61, 301], [32, 16], dropout=0.5)
    batch = _batch()
    before = torch.get_rng_state()
    choose_num_workers(model, BINARY, lambda i: batch, CPU, None, lambda k: 0.0)
    step_memory_bytes(model, BINARY, 32, batch, CPU, None)
    assert torch.equal(torch.get_rng_state(), before)


def test_micro_batch_search_finds_the_largest_fitting_divisor() -> None:
    model = _model()
    need = {b: step_memory_bytes(model, BINARY, b, _batch(), CPU, None) for b in (40, 41, 64)}
    assert need[40] < need[41] < need[64]  # memory grows with the batch
    search = find_micro_batch(model, BINARY, 96, _batch(), CPU, None, budget_bytes=need[40] + (need[41] - need[40]) // 2)
    assert search.max_fitting == 40
    assert search.micro_batch == 32 and search.grad_accum == 3  # 32 divides 96; 40 does not
    assert len(search.probes) < 20  # doubling, then bisection
    roomy = find_micro_batch(model, BINARY, 96, _batch(), CPU, None, budget_bytes=need[64] * 4)
    assert (roomy.micro_batch, roomy.grad_accum) == (96, 1)  # never above the effective batch


def test_auto_batch_size_keeps_the_effective_batch_under_a_simulated_limit(small_config: RetrainConfig) -> None:
    from training.model.network import ModelSchema
    from training.model.spec import build_model

    small_config.train.auto_batch_size = True
    small_config.train.max_steps = 20
    small_config.train.device = "cpu"  # the simulated limit stands in for memory only where none is measured
    job = make_job(small_config)
    stats = FeatureStats.from_json(Path(job.stats_path).read_text())
    model = build_model(small_config.model, ModelSchema.of(stats))
    # Room for 40 rows (after the 0.9 safety margin), not for the configured 128.
    need40, need41 = (step_memory_bytes(model, BINARY, b, _batch(), CPU, None) for b in (40, 41))
    job.config.train.simulated_memory_mb = (need40 + need41) / 2 / 0.9 / (1 << 20)
    result = train(job)
    layout = result.batch_layout
    assert layout is not None and layout.auto is not None and layout.auto.max_fitting == 40
    assert layout.micro_batch == 32 and layout.grad_accum == 4  # 32 x 4 = the configured 128
    assert result.samples_seen == 20 * 128


@pytest.mark.slow
def test_compiled_model_trains_like_the_eager_one(small_config: RetrainConfig, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """...and the warm-up compiles the graph the steps run (grad mode, autocast, the
    micro-batch's shape): no step recompiles, so compile time never lands in the step times."""
    small_config.train.max_steps = 20
    eager = train(make_job(small_config, "eager"))
    small_config.train.compile = True
    warmed_up = Trainer._warm_up

    def then_no_recompile(self, compiled):  # type: ignore[no-untyped-def]
        warmed_up(self, compiled)
        monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)

    monkeypatch.setattr(Trainer, "_warm_up", then_no_recompile)
    compiled = train(make_job(small_config, "compiled"))
    assert compiled.compile_seconds > 0
    assert abs(compiled.best_val_auc - eager.best_val_auc) < 1e-3


@pytest.mark.slow
def test_worker_memory_does_not_grow_over_epochs(small_config: RetrainConfig) -> None:
    """One endless stream over all epochs: workers are started once and hold at most their
    shard cache, so their RSS is flat from epoch to epoch (the WebDataset-style leak of
    re-created per-epoch iterators cannot happen)."""
    from training.data.prepare.features import FeatureStats
    from training.data.load.loader import ShardBatches, StreamPosition, make_train_loader
    from training.data.manifest import load_manifest

    job = make_job(small_config)
    manifest = load_manifest(Path(job.dataset_dir))
    stats = FeatureStats.from_json(Path(job.stats_path).read_text())
    batches = ShardBatches(Path(job.dataset_dir), manifest, "train", 64, stats.transformer())
    loader = make_train_loader(batches, StreamPosition(), 2, pin_memory=False)
    it = iter(loader)

    def workers_rss() -> int:
        total = 0
        for w in it.workers:
            with open(f"/proc/{w.pid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024
        return total

    per_epoch = batches.batches_per_epoch
    rss = []
    for _ in range(6):
        for _ in range(per_epoch):
            next(it)
        rss.append(workers_rss())
    it._shutdown_workers()
    assert max(rss[2:]) - rss[1] < 8 << 20, [r >> 20 for r in rss]


def test_linear_lr_scaling_rule_follows_the_effective_batch(small_config: RetrainConfig) -> None:
    from training.config import load_config
    from training.errors import ConfigError

    small_config.train.optim.lr_reference_batch = 64
    small_config.train.grad_accum = 2
    assert small_config.train.peak_lr() == pytest.approx(small_config.train.optim.lr * 128 * 2 / 64)
    small_config.train.max_steps = 10
    small_config.train.eval_every = 10
    result = train(make_job(small_config))
    assert result.batch_layout.peak_lr == pytest.approx(small_config.train.optim.lr * 4)
    # Warmup is what makes a scaled-up rate safe: without it, refuse.
    with pytest.raises(ConfigError, match="warmup_steps"):
        load_config(overrides=["train.optim.lr_reference_batch=256", "train.schedule.warmup_steps=0"])


def test_gradient_checkpointing_saves_memory_and_changes_no_gradient() -> None:
    """Every other block is recomputed in backward: the same gradients (dropout included, as
    the recomputation replays the RNG), fewer bytes kept for backward."""
    torch.manual_seed(0)
    plain = TabularMLP(6, [41, 4, 61, 301], [256, 256, 128, 64], dropout=0.2)
    recomputed = TabularMLP(6, [41, 4, 61, 301], [256, 256, 128, 64], dropout=0.2, gradient_checkpointing=True)
    recomputed.load_state_dict(plain.state_dict())
    batch = _batch(256)
    x_num, x_cat, y = batch.num, batch.cat, batch.label
    grads = []
    for model in (plain, recomputed):
        torch.manual_seed(1)
        torch.nn.functional.binary_cross_entropy_with_logits(model(x_num, x_cat), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads, strict=True))
    assert (step_memory_bytes(recomputed, BINARY, 256, batch, CPU, None)
            < step_memory_bytes(plain, BINARY, 256, batch, CPU, None))
