"""The figures the benchmarks page leads with: each with its target, where it is read from, and
one line saying what the reference is, including where that reference is not yet a fair one."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HEADLINES", "Headline"]


@dataclass(frozen=True)
class Headline:
    figure: str
    result: str  # benchmarks/results/<result>.json
    idle: str  # the key of the idle figure in that file
    loaded: str | None  # the key of the figure beside a one-core burner; None: not measured
    target: float
    at_most: bool  # met when the figure is at most the target (else: at least)
    reference: str
    fair: bool  # the reference is one a skeptic accepts: only then is the target judged
    idle_per_round: str | None = None  # the key of the idle figure's rounds; None: `<idle>_per_round`
    loaded_per_round: str | None = None  # likewise for the loaded figure

    @property
    def idle_rounds(self) -> str:
        return self.idle_per_round or f"{self.idle}_per_round"

    @property
    def loaded_rounds(self) -> str | None:
        return self.loaded_per_round or (f"{self.loaded}_per_round" if self.loaded else None)

    def met(self, value: float | None) -> str:
        if value is None:
            return "not measured"
        if not self.fair:
            return "not judged: reference not yet fair"
        return "met" if (value <= self.target if self.at_most else value >= self.target) else "not met"


HEADLINES = (
    Headline("training time / Lightning's", "lightning", "idle_project_vs_lightning", "loaded_project_vs_lightning",
             0.83, True, "Lightning's Trainer at the threads the project chose, tensors built before the clock, "
             "batches gathered by index, the same clipping and schedule, torch's default AdamW (the project: its "
             "fused kernel)", fair=True),
    Headline("training time / a plain PyTorch loop's", "lightning", "idle_project_vs_plain",
             "loaded_project_vs_plain", 1.05, True, "a plain loop set up as the Lightning reference", fair=True),
    Headline("training time / a plain loop's with fused AdamW", "lightning", "idle_project_vs_plain_fused",
             "loaded_project_vs_plain_fused", 1.05, True, "the plain loop with the project's optimiser kernel: what "
             "the project's loop costs beyond it", fair=True),
    Headline("first-epoch speed / the best loader peer's", "peers", "cold_ratio_project_one_thread_over_best_peer",
             "loaded_cold_ratio_project_one_thread_over_best_peer", 1.5, False,
             "WebDataset, LitData, MosaicML Streaming at their defaults, every read from a cold page cache, the "
             "project on one prefetch thread; each peer in the faster of its consumer's thread and one thread beside "
             "it, with its whole pipeline there; median of per-round ratios", fair=True),
    Headline("training loop overhead / a bare loop", "overhead", "loop_overhead_fraction_same_threads_idle",
             "loop_overhead_fraction_same_threads_loaded", 0.05, True,
             "a bare loop over pre-built batches at the project's threads, the same math; the project's data "
             "comes through its loader from several train shards, read inside the timed loop", fair=True,
             idle_per_round="loop_overhead_fraction_same_threads_per_round_idle",
             loaded_per_round="loop_overhead_fraction_same_threads_per_round_loaded"),
    Headline("checkpoint stall / a durable torch.save", "checkpoint", "charged_stall_ratio_vs_durable_torch_save",
             "loaded_charged_stall_ratio_vs_durable_torch_save", 0.3, True,
             "torch.save and fsync; the stall is what a training loop's steps took beyond the same steps without "
             "a save, so the writer's CPU is charged. Beside the burner, 2 cores leave the writer no core of its "
             "own", fair=True),
    Headline("predict speed / a bare model loop", "predict", "ratio_predict_vs_bare", "loaded_ratio_predict_vs_bare",
             0.8, False,
             "a bare model(x) loop over the same rows, transformed and in memory, at the same threads", fair=True),
)
