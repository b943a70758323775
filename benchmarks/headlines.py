"""The figures the benchmarks page leads with: each with its target, where it is read from, and
one line saying what the reference is, including where that reference is not yet a fair one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    # Why a condition misses its target, from the measurements that show it: a template over the
    # result file's keys, per condition ("idle", "loaded"); shown under the table while it misses.
    why: tuple[tuple[str, str], ...] = ()
    # The key, per condition, of the measurement's own noise (the reference measured against
    # itself): shown beside the figure, since a target inside it is not resolved by the figure.
    noise: tuple[tuple[str, str], ...] = ()

    @property
    def idle_rounds(self) -> str:
        return self.idle_per_round or f"{self.idle}_per_round"

    @property
    def loaded_rounds(self) -> str | None:
        return self.loaded_per_round or (f"{self.loaded}_per_round" if self.loaded else None)

    def why_missed(self, condition: str, result: dict[str, Any]) -> str | None:
        """The measured reason `condition` misses its target, or None when none is recorded (or
        the result lacks a key it names: a result from before the benchmark measured it)."""
        template = dict(self.why).get(condition)
        if template is None:
            return None
        try:
            return template.format_map(result)
        except (KeyError, ValueError, TypeError):
            return None

    def met(self, value: float | None, noise: float | None = None, stale: bool = False) -> str:
        """"met" only when the figure clears the target by more than the noise its reference
        measured against itself; nearer than that, "within noise". A stale figure (the code it
        measured has changed since) gets no verdict: it describes other code."""
        if value is None:
            return "not measured"
        if stale:
            return "stale: no verdict until rerun"
        if not self.fair:
            return "not judged: reference not yet fair"
        if noise is not None and abs(value - self.target) <= noise:
            return "within noise"
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
             "the project's loop costs beyond it", fair=True,
             noise=(("idle", "idle_plain_fused_again_spread"), ("loaded", "loaded_plain_fused_again_spread")),
             why=tuple((c, "the project's run is its optimizer steps ({" + c + "_project_steps_seconds} s) and {" + c +
                        "_project_outside_steps_seconds} s around them (opening the packed data, building the model, "
                        "the stalls of its {" + c + "_project_checkpoints} periodic checkpoints, the validation, "
                        "writing the result), medians of rounds " + ("idle" if c == "idle" else "beside the burner") +
                        ". Its steps alone take {" + c + "_project_steps_vs_plain_fused} of the plain fused loop's "
                        "whole run ({" + c + "_plain_fused_seconds} s), and that loop run twice in the same rounds "
                        "lands ±{" + c + "_plain_fused_again_spread} apart (rounds: {" + c + "_plain_fused_again_"
                        "fraction_per_round}).")
                       for c in ("idle", "loaded"))),
    Headline("first-epoch speed / the best loader peer's", "peers", "cold_ratio_project_one_thread_over_best_peer",
             "loaded_cold_ratio_project_one_thread_over_best_peer", 1.5, False,
             "WebDataset, LitData, MosaicML Streaming at their defaults, every read from a cold page cache, the "
             "project on one prefetch thread; each peer in the faster of its consumer's thread and one thread beside "
             "it, with its whole pipeline there; median of per-round ratios", fair=True,
             why=tuple((c, "on one prefetch thread the project's loader is bound by one core, as WebDataset is: a cold "
                        "epoch took {" + k + "seconds_medians[project-1]} s with {" + k + "cores_used_medians[project-1]} "
                        "cores busy and {" + k + "cpu_seconds_per_million_rows[project-1]} CPU seconds per million "
                        "rows, against WebDataset's {" + k + "seconds_medians[webdataset]} s, {" + k +
                        "cores_used_medians[webdataset]} cores and {" + k + "cpu_seconds_per_million_rows[webdataset]} "
                        "s (medians). On one core each, speed follows CPU per row, and 1.5x needs the project's CPU "
                        "per row at two thirds of WebDataset's. "
                        "Its default two prefetch threads took {" + k + "seconds_medians[project]} s " +
                        ("idle, with the second core free" if c == "idle" else "beside the burner") + ".")
                       for c, k in (("idle", "cold_"), ("loaded", "loaded_cold_")))),
    Headline("training loop overhead / a bare loop", "overhead", "loop_overhead_fraction_same_threads_idle",
             "loop_overhead_fraction_same_threads_loaded", 0.05, True,
             "a bare loop over pre-built batches at the project's threads, the same math; the project's data "
             "comes through its loader from several train shards, read inside the timed loop", fair=True,
             idle_per_round="loop_overhead_fraction_same_threads_per_round_idle",
             loaded_per_round="loop_overhead_fraction_same_threads_per_round_loaded",
             noise=(("idle", "bare_loop_again_spread_idle"), ("loaded", "bare_loop_again_spread_loaded")),
             why=tuple((c, "what the project's step does beyond the bare loop's (its timing, heartbeat, schedule "
                        "and budget checks, and the loader's batch), measured idle on a tiny model whose math is a "
                        "small part of a step, is {per_step_work_beyond_bare_us} µs a step (rounds: "
                        "{per_step_work_beyond_bare_us_per_round}): {per_step_work_share_of_a_step_" + c + "} of a "
                        "default-model step " + ("idle" if c == "idle" else "beside the burner") + " ({default_model_"
                        "bare_step_us_" + c + "} µs), against the measured {loop_overhead_fraction_same_threads_" + c +
                        "}, whose rounds spread as far as the same bare loop run twice does (±{bare_loop_again_"
                        "spread_" + c + "}). A model whose step takes longer pays the same "
                        "microseconds as a smaller share.")
                       for c in ("idle", "loaded"))),
    Headline("checkpoint stall / a durable torch.save", "checkpoint", "charged_stall_ratio_vs_durable_torch_save",
             "loaded_charged_stall_ratio_vs_durable_torch_save", 0.3, True,
             "torch.save and fsync; the stall is what a training loop's steps took beyond the same steps without "
             "a save, so the writer's CPU is charged", fair=True,
             noise=(("idle", "charged_again_spread"), ("loaded", "loaded_charged_again_spread")),
             why=(("loaded", "the loop trains on {loaded_charged_threads} thread in both conditions. Idle, the "
                   "background writer has the second core and a save stalls training {charged_stall_per_save_seconds} "
                   "s; beside the burner the writer's work ({loaded_background_write_cpu_seconds} CPU-s per save on "
                   "its own thread, serialising and hashing, plus the kernel's writeback for the fsync) can only come "
                   "out of the two busy cores, so training gives up its share of it: the stall is "
                   "{loaded_charged_stall_per_save_seconds} s against a durable torch.save's "
                   "{loaded_durable_torch_save_seconds} s, while save() itself blocks the loop "
                   "{loaded_loop_stall_per_save_seconds} s; the same steps without a save, run twice, land "
                   "±{loaded_charged_again_spread} of a save apart (rounds: {loaded_charged_again_spread_per_round}). "
                   "A machine with a core free beside training is the idle condition."),)),
    Headline("predict speed / a bare model loop", "predict", "ratio_predict_vs_bare_inference_mode",
             "loaded_ratio_predict_vs_bare_inference_mode", 0.8, False,
             "a bare model(x) loop over the same rows, transformed and in memory, at the same threads, under "
             "torch.inference_mode as predict runs (the fastest honest floor; under no_grad it is slower)", fair=True,
             why=tuple((c, "predict does {" + k + "cpu_predict_over_bare}x the bare loop's CPU work per row (reading "
                        "the Parquet, checking, encoding and transforming the features, writing the scores), on a "
                        "reading and a writing thread beside the model's, so its speed over the bare loop's is about "
                        "the cores it keeps busy over that CPU ratio: " + ("idle" if c == "idle" else "beside the "
                        "burner") + " it keeps {" + k + "predict_cores_used} cores busy, and the ratio to the "
                        "no_grad loop, {" + k + "ratio_predict_vs_bare}, is about {" + k + "predict_cores_used} / {" + k +
                        "cpu_predict_over_bare} (medians of rounds); the inference_mode loop is faster still. Meeting "
                        "0.8 takes 0.8 times that CPU ratio in cores, which a machine with a core free beside the model "
                        "gives it; on 2 cores beside a one-core burner, it "
                        "takes predict's work beyond the model's falling to a quarter of the model's.")
                       for c, k in (("idle", ""), ("loaded", "loaded_")))),
    Headline("tuning spend to random search's best / random search's", "tuning_replay", "worst_default_ratio", None,
             0.5, True, "random search of the same N configurations at full fidelity, replayed on recorded learning "
             "curves of three tables (the demo, fair, randhie) in 200 random orders at N = 10, 20, 40; the figure is "
             "`retrain tune`'s default schedule at its dearest table and N", fair=True,
             idle_per_round="default_ratios",
             why=(("idle", "the default is dearest on {worst_default[table]} at N = {worst_default[n]}: "
                   "{worst_default[ratio]}x random search's machine seconds to reach random search's best final "
                   "{worst_default[metric]}, and in {worst_default[missed]} of {worst_default[orders]} orders it never "
                   "reached it: no trial it trained to the end scored as high, so the configuration random search "
                   "found best was stopped at an early rung (or not reached within the budget). A miss is charged "
                   "the whole budget. On that table the final scores run from a median of "
                   "{worst_default[median_final]} to a best of {worst_default[best_final]} over "
                   "{worst_default[configurations]} configurations. The default's ratios over every table and N: "
                   "{default_ratios}."),)),
)
