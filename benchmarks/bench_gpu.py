"""The GPU check: what the training core does on one CUDA GPU, in a window of about 8 minutes.

`python -m benchmarks.run gpu` on a machine with an NVIDIA GPU (see docs/development.md for the
short-lived GPU machine and `benchmarks/gpu_check.sh`, which runs this with the cuda test tier).
Each part runs in its own process, cut at its time budget: determinism, compile caches and CUDA
memory are process-wide, and a part that hangs or runs out of memory must not take the others
with it. A part that fails records its error; the others still run.

Parts:
- probes: the device, what `train.precision: auto` picks, and single-op checks of the paths
  that only a GPU exercises (piecewise embeddings under deterministic kernels, the quantile
  label transform, the stop agreement on an nccl group, CUDA RNG states from a bigger machine,
  host syncs in a text step);
- precision: the shipped defaults in bf16 against fp32 (loss curves and validation metric);
- resume: SIGKILL twice and resume, against an uninterrupted run, on the GPU;
- perf: bf16 against fp32 step time and peak memory, the MLP and the text transformer;
- graph: the captured step replayed against the eager step under deterministic kernels;
- busy: the GPU's busy share of the training steps' own span, steps a second and dollars per
  100k steps, for the default MLP, the shipped text model and the 6x384 transformer, eager and
  with the step captured (and what train.step auto picked);
- plan: `retrain plan`'s predicted H100 step time against the one measured here, with the
  priors of the run and with the priors shipped now (fitted to an earlier run of this part);
- compile: torch.compile's speed-up, and the graphs compiled after the first step;
- autobatch: the auto batch size on real CUDA memory, and the end-of-run fp32 re-timing.

`GPU_CHECK_QUICK=1` rehearses every part on a CPU at toy sizes: it checks this file, not a GPU.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from training.data.batch import Batch

QUICK = os.environ.get("GPU_CHECK_QUICK") == "1"
CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
BF16 = torch.bfloat16 if CUDA else None
# Seconds each part may take on an H100 (the rehearsal on a CPU gets GPU_CHECK_SCALE times more).
BUDGETS = {"probes": 40, "prep": 60, "precision": 60, "resume": 90, "graph": 45, "perf": 45, "busy": 200, "plan": 90,
           "compile": 120, "autobatch": 50}
# The parts whose figures are timings: they wait until the GPU is otherwise idle (see run).
TIMED = ("perf", "busy", "plan", "compile", "autobatch")
N_ROWS = {"tabular": 4000, "text": 2000, "image": 1000} if QUICK else {"tabular": 40000, "text": 12000, "image": 6000}
FAMILY = {
    "tabular": ["train.batch_size=512"],
    "text": ["data.label=positive", "data.text=[review]", "data.numeric=[]", "data.categorical=[]",
             "preprocess.max_tokens=128", "model.text_dim=128", "model.text_layers=2", "train.batch_size=256"],
    "image": ["data.task=multiclass", "data.label=shape", "data.image=[image]", "data.numeric=[]",
              "data.categorical=[]", "model.image_channels=[32, 64]", "train.batch_size=256"],
}
TRANSFORMER = ["model.text_dim=384", "model.text_layers=6", "model.text_heads=6"]
MLP = ["model.hidden=[512, 256]"]


# -- the parent: one child per part ------------------------------------------------------------

def run(work: Path) -> dict[str, Any]:
    """Every part in its own process under `work`; the results keyed by part, and the headline
    figures first."""
    lines = work / "results.jsonl"
    # A rehearsal on a small CPU runs the GPU's sizes of some parts (the fp32/bf16 timings, the
    # busy share's loops): four times the GPU's budget lets each part finish, so each is checked.
    scale = float(os.environ.get("GPU_CHECK_SCALE", "4" if QUICK and not CUDA else "1"))
    parts: dict[str, dict[str, Any]] = {}
    only = [p for p in os.environ.get("GPU_CHECK_PARTS", "").split(",") if p]  # a rerun of some parts
    quiet_after = os.environ.get("GPU_CHECK_QUIET_AFTER")  # a file that exists while other work uses the GPU
    for part, budget in BUDGETS.items():
        if only and part not in only and part != "prep":
            continue
        if part in TIMED and quiet_after:
            waited = time.perf_counter()
            while Path(quiet_after).exists() and time.perf_counter() - waited < 300:
                time.sleep(0.5)
        t0 = time.perf_counter()
        env = {**os.environ, "GPU_CHECK_WORK": str(work), "PYTHONUNBUFFERED": "1"}
        try:
            subprocess.run([sys.executable, "-m", "benchmarks.bench_gpu", part], env=env, timeout=budget * scale,
                           check=False)
        except subprocess.TimeoutExpired:
            parts.setdefault(part, {"ok": False, "error": f"cut at its budget of {budget * scale:.0f} s"})
        print(f"== {part}: {time.perf_counter() - t0:.1f} s", flush=True)
        if lines.exists():
            for line in lines.read_text().splitlines():
                record = json.loads(line)
                parts[record.pop("part")] = record
            lines.unlink()
    failed = sorted(name for name, record in parts.items() if not record.get("ok"))
    print("== every part ok" if not failed else f"== parts that failed: {', '.join(failed)} (why: gpu.json's detail)",
          flush=True)
    return headlines(parts)


def headlines(parts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The figures the benchmarks page shows, each from its part (None where the part failed),
    then the parts' own records as `detail` (kept in the file, left off the page)."""
    from training.cost.hardware import GPUS
    from training.cost.roofline import predict_step
    from training.cost.step_count import StepCount

    def get(part: str, *keys: str) -> Any:
        value: Any = parts.get(part, {})
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    def ms(seconds: Any) -> Any:
        return seconds * 1000 if isinstance(seconds, float) else None

    def plan_row(family: str) -> dict[str, Any]:
        count = get(f"plan_{family}", "count")
        predicted = get(f"plan_{family}", "predicted_s") or [None, None, None]
        now = predict_step(StepCount(**count), GPUS["H100"], 1, "auto") if count else None
        measured = get(f"plan_{family}", "measured_s")
        return {"micro_batch": get(f"plan_{family}", "micro_batch"), "kernels": (count or {}).get("kernels"),
                "measured_step_ms": ms(measured), "measured_loop_step_ms": ms(get(f"plan_{family}", "loop_s")),
                "predicted_ms_at_run": ms(predicted[1]), "measured_over_predicted_at_run":
                get(f"plan_{family}", "measured_over_predicted"),
                "predicted_ms_shipped_priors": ms(now.mid) if now else None,
                "measured_over_predicted_shipped_priors": measured / now.mid if now and measured else None}

    def precision_row(name: str) -> dict[str, Any]:
        return {"micro_batch": get(f"perf_{name}", "micro_batch"), "fp32_step_ms": ms(get(f"perf_{name}", "fp32", "step_s")),
                "bf16_step_ms": ms(get(f"perf_{name}", "bf16", "step_s")), "bf16_speedup": get(f"perf_{name}", "speedup_bf16"),
                "bf16_peak_memory_over_fp32": get(f"perf_{name}", "peak_ratio_bf16")}

    def compile_row(name: str) -> dict[str, Any]:
        return {"micro_batch": get(f"compile_{name}", "micro_batch"), "eager_step_ms": ms(get(f"compile_{name}", "eager_s")),
                "compiled_step_ms": ms(get(f"compile_{name}", "compiled_s")), "speedup": get(f"compile_{name}", "speedup"),
                "compile_seconds": get(f"compile_{name}", "warmup_compile_s"),
                "graphs_added_after_step_1": get(f"compile_{name}", "graphs_added_after_step_1")}

    def busy_row(name: str) -> dict[str, Any]:
        feeds = ("", "_streamed") if name == "mlp" else ("",)
        rows = {}
        for feed in feeds:
            for step in ("eager", "graph", "auto"):
                key = f"busy_{name}{feed}_{step}"
                rows[f"{(feed.strip('_') + ' ') if feed else ''}{step}"] = {
                    "busy_fraction_of_steps": get(key, "busy_fraction"), "steps_per_second": get(key, "steps_per_second"),
                    "dollars_per_100k_steps": get(key, "dollars_per_100k_steps"),
                    "ran_as": get(key, "step_mode", "step"), "precision": get(key, "precision")}
        return rows

    def auto_row(name: str) -> dict[str, Any]:
        """What train.step, precision and compile auto picked, against the fastest measured."""
        measured = {step: get(f"busy_{name}_{step}", "steps_per_second") for step in ("eager", "graph")}
        fastest = max((s for s in measured if measured[s]), key=lambda s: measured[s], default=None)
        return {"auto_ran_as": get(f"busy_{name}_auto", "step_mode", "step"),
                "auto_precision": get(f"busy_{name}_auto", "precision"),
                "auto_compiled": get(f"busy_{name}_auto", "compiled"), "fastest_step": fastest,
                "auto_over_fastest_steps_per_second": (get(f"busy_{name}_auto", "steps_per_second") or 0)
                / measured[fastest] if fastest else None}

    return {
        "device": get("env", "device"),
        "torch": get("env", "torch"),
        "auto_precision": get("env", "auto_precision"),
        "bf16_vs_fp32_loss_max_relative_difference": get("precision", "loss_rel_max"),
        "bf16_vs_fp32_validation_metric_gap": get("precision", "metric_gap"),
        "sigkill_resume_bit_identical": get("resume", "bit_identical"),
        "graph_bit_identical_to_eager": get("graph", "bit_identical"),
        "gpu_busy_fraction_of_steps_mlp_graph": get("busy_mlp_graph", "busy_fraction"),
        "gpu_busy_fraction_of_steps_text_graph": get("busy_text_graph", "busy_fraction"),
        "gpu_busy_fraction_of_steps_transformer_graph": get("busy_transformer_graph", "busy_fraction"),
        "mlp_dollars_per_100k_steps_graph": get("busy_mlp_graph", "dollars_per_100k_steps"),
        "mlp_dollars_per_100k_steps_eager": get("busy_mlp_eager", "dollars_per_100k_steps"),
        "auto_batch_micro_batch": get("autobatch", "micro"),
        "auto_batch_real_steps_peak_bytes": get("autobatch", "real_steps_peak_bytes"),
        "auto_batch_fp32_retiming": get("autobatch", "fp32_slowdown_at_auto_batch"),
        "probes_passed": [k.removeprefix("probe_") for k, v in parts.items() if k.startswith("probe_") and v.get("ok")],
        "probes_failed": [k.removeprefix("probe_") for k, v in parts.items() if k.startswith("probe_") and not v.get("ok")],
        "bf16_against_fp32": {name: precision_row(name) for name in ("mlp", "transformer")},
        "plan_against_measured": {family: plan_row(family) for family in FAMILY},
        "torch_compile": {name: compile_row(name) for name in ("transformer", "mlp")},
        "busy_by_model": {name: busy_row(name) for name in MODELS},
        "auto_against_fastest": {name: auto_row(name) for name in MODELS},
        "detail": parts,
    }


# -- the child: one part ---------------------------------------------------------------------

WORK = Path(os.environ.get("GPU_CHECK_WORK", "/tmp/gpu-check"))


def record(part: str, **fields: Any) -> None:
    line = json.dumps({"part": part, **fields}, default=str)
    with open(WORK / "results.jsonl", "a") as f:
        f.write(line + "\n")
    print(line[:2000], flush=True)


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def reset_determinism() -> None:
    """The trainer only ever switches deterministic kernels on, process-wide."""
    torch.use_deterministic_algorithms(False)


@functools.lru_cache(maxsize=None)
def sources() -> dict[str, Path]:
    from training.data.ingest.demo import ensure_demo_dataset, ensure_reviews_demo, ensure_shapes_demo

    return {"tabular": ensure_demo_dataset(WORK / "gen-tab", rows=N_ROWS["tabular"], seed=7)[0],
            "text": ensure_reviews_demo(WORK / "gen-text", rows=N_ROWS["text"]),
            "image": ensure_shapes_demo(WORK / "gen-img", rows=N_ROWS["image"])}


def job(family: str, name: str, *extra: str) -> Any:
    """A packed, preprocessed job of `family` (content-addressed under WORK: parts share them)."""
    from benchmarks.common import train_job

    base = [f"data.source={sources()[family]}", "train.loader.num_workers=0", "train.max_steps=200",
            "train.eval_every=50", "train.checkpoint.every=25", "train.schedule.warmup_steps=10", "train.patience=0"]
    return train_job(WORK / family, name, base + FAMILY[family] + list(extra))


def trained(j: Any) -> Any:
    """train(j)'s TrainResult (a whole run: no rung, rank 0)."""
    from training.protocol.results import TrainResult
    from training.trainer.run import train

    result = train(j)
    assert isinstance(result, TrainResult)
    return result


def history(result: Any) -> list[dict[str, Any]]:
    return [{"step": v.step, "loss": v.train_loss, **v.metrics} for v in result.history]


def part_probes() -> None:
    from types import SimpleNamespace

    from training.trainer.precision import resolve_precision

    record("env", ok=True, device=torch.cuda.get_device_name() if CUDA else "cpu", torch=torch.__version__,
           cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version() if CUDA else None,
           bf16_native=torch.cuda.is_bf16_supported(including_emulation=False) if CUDA else None,
           auto_precision=resolve_precision("auto", DEV),
           memory_total=torch.cuda.get_device_properties(DEV).total_memory if CUDA else None)

    def probe(name: str, fn: Callable[[], Any]) -> None:
        try:
            record(f"probe_{name}", ok=True, value=fn())
        except Exception as err:  # noqa: BLE001 - a failed probe is the finding
            record(f"probe_{name}", ok=False, error=f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")

    def piecewise() -> list[float]:
        from training.model.piecewise import PiecewiseLinear

        bins = [torch.linspace(-2, 2, 9) for _ in range(3)]
        emb = PiecewiseLinear(bins, 8).to(DEV)
        torch.use_deterministic_algorithms(True)
        try:
            x = torch.randn(16, 3, device=DEV, requires_grad=True)
            emb(x).sum().backward()
            with torch.no_grad():
                return emb(x)[0, 0, :3].tolist()
        finally:
            torch.use_deterministic_algorithms(False)

    def quantile() -> list[float]:
        from training.model.target_transform import LabelTransform

        stats = SimpleNamespace(target_transform="quantile", label_mean=0.0, label_std=1.0,
                                target_knots=[0.0, 0.5, 1.0, 2.0])
        return LabelTransform(stats).target(torch.tensor([0.2, 1.5], device=DEV)).tolist()  # type: ignore[arg-type]

    def nccl() -> Any:
        import torch.distributed as dist

        from training.trainer.stopping import agree_across_ranks

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533", RANK="0", WORLD_SIZE="1")
        dist.init_process_group("nccl" if CUDA else "gloo", rank=0, world_size=1)
        try:
            return agree_across_ranks(False, "completed", True, 0, DEV)
        finally:
            dist.destroy_process_group()

    def rng_from_more_gpus() -> int:
        from training.trainer.rng import capture_rng, restore_rng

        state = capture_rng()
        state["cuda"] = list(state.get("cuda", [])) * 8
        restore_rng(state)
        return len(state["cuda"])

    def text_step_syncs() -> list[str]:
        import warnings

        from training.model.encoders import TextEncoder

        enc = TextEncoder(1000, 64, 64, 1, 4).to(DEV)
        tok = torch.randint(1, 1000, (32, 1, 64), device=DEV, dtype=torch.int32)
        ntok = torch.randint(2, 64, (32, 1), device=DEV)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if CUDA:
                torch.cuda.set_sync_debug_mode("warn")
            enc(tok, ntok).sum().backward()
            if CUDA:
                torch.cuda.set_sync_debug_mode(0)
        # Each sync's warning, with the line of the model that caused it.
        return [f"{Path(w.filename).name}:{w.lineno}: {str(w.message)[:120]}" for w in seen
                if "synchroniz" in str(w.message)][:5]

    probe("piecewise_deterministic", piecewise)
    probe("quantile_target_on_device", quantile)
    probe("stop_agreement_on_the_device", nccl)
    probe("rng_from_a_machine_with_more_gpus", rng_from_more_gpus)
    probe("text_step_host_syncs", text_step_syncs)


def part_prep() -> None:
    t0 = time.perf_counter()
    for family in FAMILY:
        job(family, "prep")
    record("prep", ok=True, seconds=time.perf_counter() - t0)


def part_precision() -> None:
    """The shipped defaults (piecewise embeddings, deterministic kernels, precision auto) against
    the same run in fp32."""

    steps = ["train.max_steps=60", "train.eval_every=20"] if QUICK else ["train.max_steps=400"]
    out: dict[str, Any] = {}
    for precision in ("auto", "fp32"):
        reset_determinism()
        r = trained(job("tabular", f"precision-{precision}", *steps, f"train.precision={precision}"))
        out[precision] = {"precision": r.precision, "device": r.device, "history": history(r),
                          "metric": r.best_val_metric, "steps_per_s": r.steps / r.seconds.train,
                          "peak_bytes": r.accelerator.memory_peak_bytes}
    a, b = out["auto"]["history"], out["fp32"]["history"]
    loss_rel = max(abs(x["loss"] - y["loss"]) / max(abs(y["loss"]), 1e-9) for x, y in zip(a, b, strict=True))
    gap = abs(out["auto"]["metric"] - out["fp32"]["metric"])
    record("precision", ok=out["auto"]["precision"] == ("bf16" if CUDA else "fp32") and gap <= 0.005,
           loss_rel_max=loss_rel, metric_gap=gap, **out)


def part_resume() -> None:
    """SIGKILL twice and resume: the final weights and history against a run never killed.
    Dropout on, so the CUDA generator's state must survive each checkpoint."""
    from benchmarks.common import signal_at_step
    from training.errors import Preempted
    from training.launch.process import run_training_process

    n, every, kills = (60, 10, [15, 35]) if QUICK else (200, 25, [60, 130])
    common = [f"train.max_steps={n}", f"train.checkpoint.every={every}", "model.dropout=0.1"]
    reference = run_training_process(job("tabular", "resume-reference", *common))
    killed = job("tabular", "resume-killed", *common)
    seen = []
    for target in kills:
        try:
            run_training_process(killed, on_start=signal_at_step(killed.run_dir, target, signal.SIGKILL))
            seen.append({"target": target, "result": "finished before the kill"})
        except Preempted as err:
            seen.append({"target": target, "killed": str(err)[:160]})
    final = run_training_process(killed)
    same = final.model.sha256 == reference.model.sha256
    record("resume", ok=same and final.history == reference.history, bit_identical=same,
           history_equal=final.history == reference.history, kills=seen, resumed_from=final.resumed_from_steps,
           precision=final.precision, device=final.device)


def _real_batches(family: str, micro: int, *extra: str, n: int = 8) -> tuple[Any, Any, list[Batch]]:
    """(model, task, batches on the device) from the family's packed data."""
    from training.data.prepare.features import DERIVED_DIR, FeatureStats
    from training.data.load.loader import ShardBatches
    from training.data.manifest import require_manifest
    from training.model.network import ModelSchema
    from training.model.spec import build_model
    from training.model.objectives import Task

    j = job(family, "bench", *extra)
    stats = FeatureStats.from_json(Path(j.stats_path).read_text())
    transform = stats.transformer(Path(j.stats_path).parent / DERIVED_DIR)
    sb = ShardBatches(Path(j.dataset_dir), require_manifest(Path(j.dataset_dir)), "train", micro, transform, seed=0)
    batches = [sb.batch(0, i % sb.batches_per_epoch).map(lambda v: v.to(DEV)) for i in range(n)]
    torch.manual_seed(0)
    model = build_model(j.config.model, ModelSchema.of(stats)).to(DEV).train()
    return model, Task.of(stats), batches


def _step_time(model: Any, task: Any, batches: list[Batch], dtype: torch.dtype | None,
               steps: int, warm: int = 10) -> dict[str, Any]:
    """Median seconds of a whole optimizer step (fused AdamW, as the trainer uses), the loader
    left out: what the GPU does."""
    from training.model.network import forward_fn

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True if CUDA else None)
    forward = forward_fn(model)
    if CUDA:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(warm + steps):
        sync()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        task.forward_loss(forward, batches[i % len(batches)], DEV, dtype).backward()
        opt.step()
        sync()
        if i >= warm:
            times.append(time.perf_counter() - t0)
    times.sort()
    return {"step_s": times[len(times) // 2], "peak_bytes": torch.cuda.max_memory_allocated() if CUDA else None}


def part_perf() -> None:
    """bf16 against fp32 at a batch that keeps the GPU busy: the MLP and the text transformer."""
    cases = {"mlp": ("tabular", 64 if QUICK else 8192, MLP),
             "transformer": ("text", 16 if QUICK else 256, TRANSFORMER)}
    for name, (family, micro, extra) in cases.items():
        res: dict[str, Any] = {"micro_batch": micro}
        for label, dtype in (("fp32", None), ("bf16", BF16)):
            model, task, batches = _real_batches(family, micro, *extra)
            res[label] = _step_time(model, task, batches, dtype, 3 if QUICK else 40)
            del model
        res["speedup_bf16"] = res["fp32"]["step_s"] / res["bf16"]["step_s"]
        if CUDA:
            res["peak_ratio_bf16"] = res["bf16"]["peak_bytes"] / res["fp32"]["peak_bytes"]
        record(f"perf_{name}", ok=True, **res)


def _kineto(prof: Any) -> list[Any]:
    try:
        return list(prof.profiler.kineto_results.events())
    except AttributeError:  # another torch's names
        return []


def _union(spans: list[tuple[float, float]]) -> float:
    busy, (start, end) = 0.0, spans[0]
    for s, e in spans[1:]:
        if s > end:
            busy += end - start
            start, end = s, e
        else:
            end = max(end, e)
    return busy + end - start


def _step_busy(prof: Any, skip: int = 5) -> dict[str, Any]:
    """The GPU's busy share of the training steps' own span: the kernels, copies and graphs
    launched inside the trainer's `retrain.steps` ranges (its blocks of steps; validation,
    checkpoints and set-up are outside them), after the first `skip` blocks (warm-up, capture),
    as the union of their device intervals over the span from the first to the last."""
    events = _kineto(prof)
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    ranges = sorted((e.start_ns(), e.end_ns()) for e in events if e.device_type() == cpu and e.name() == "retrain.steps")
    ranges = ranges[skip:]
    if not ranges:
        return {"busy_fraction": None, "kernels": 0, "blocks": 0}
    launched = {}
    for e in events:  # the runtime calls that launched the device's work, by correlation id
        if e.device_type() == cpu and e.name().startswith(("cudaLaunch", "cudaGraphLaunch", "cudaMemcpy", "cudaMemset")):
            launched[e.correlation_id()] = e.start_ns()
    import bisect

    starts = [r[0] for r in ranges]

    def in_steps(t: int) -> bool:
        i = bisect.bisect_right(starts, t) - 1
        return i >= 0 and t <= ranges[i][1]

    spans = sorted((e.start_ns() / 1e3, e.end_ns() / 1e3) for e in events if e.device_type() == cuda
                   and in_steps(launched.get(e.correlation_id(), -1)))
    if not spans:
        return {"busy_fraction": None, "kernels": 0, "blocks": len(ranges)}
    span = spans[-1][1] - spans[0][0]
    busy = _union(spans)
    return {"busy_fraction": busy / span, "kernel_seconds": busy / 1e6, "span_seconds": span / 1e6,
            "kernels": len(spans), "blocks": len(ranges)}


def _gpu_hour() -> tuple[float | None, str | None]:
    """Spot dollars per GPU-hour of the price table's one-GPU row for this GPU, or of its
    closest: the H100's, per GPU of its row, for a GPU the table does not list (the H200)."""
    from training.config import RetrainConfig

    prices = RetrainConfig().cost.prices
    name = torch.cuda.get_device_name() if CUDA else ""
    rows = [(k, p) for k, p in prices.items() if p.gpu and p.gpu.split("-")[0] in name and p.spot_per_hour]
    rows = rows or [(k, p) for k, p in prices.items() if p.gpu == "H100" and p.spot_per_hour]
    if not rows:
        return None, None
    key, price = min(rows, key=lambda kp: (kp[1].gpus, kp[1].spot_per_hour or 0))
    assert price.spot_per_hour is not None
    return price.spot_per_hour / price.gpus, key


MODELS = {"mlp": ("tabular", []), "text": ("text", []), "transformer": ("text", TRANSFORMER)}


def part_busy() -> None:
    """The training loop as a run runs it, under the profiler: the GPU's busy share of the
    training steps' own span, steps a second and dollars per 100k steps at the one-GPU spot
    price, for the default MLP at 512, the shipped text model and the 6x384 transformer; each
    eager and with the step captured (train.step graph: on a CPU, the capturable step as it is),
    on the split held on the device, and the MLP also streamed; and what train.step auto picked."""
    from torch.profiler import ProfilerActivity, profile

    rate, priced_as = _gpu_hour() if CUDA else (None, None)  # no GPU, no GPU price
    for name, (family, extra) in MODELS.items():
        feeds = (("", "auto"), ("_streamed", "false")) if name == "mlp" else (("", "auto"),)
        for feed, setting in feeds:
            for step in ("eager", "graph", "auto"):
                quick = ["train.max_steps=30", "train.batch_size=16"] if QUICK else ["train.max_steps=400"]
                j = job(family, f"busy-{name}{feed}-{step}", *quick, f"train.loader.resident={setting}",
                        f"train.step={step}", "train.eval_every=10" if QUICK else "train.eval_every=400",
                        "train.checkpoint.every=10" if QUICK else "train.checkpoint.every=400", *extra)
                reset_determinism()
                activities = [ProfilerActivity.CUDA, ProfilerActivity.CPU] if CUDA else [ProfilerActivity.CPU]
                with profile(activities=activities) as prof:
                    r = trained(j)
                res = _step_busy(prof) if CUDA else {"busy_fraction": None}
                per_s = r.steps / r.seconds.train if r.seconds.train else None
                record(f"busy_{name}{feed}_{step}", ok=res["busy_fraction"] is not None or not CUDA, steps=r.steps,
                       train_seconds=r.seconds.train, resident=r.num_workers.resident, steps_per_second=per_s,
                       steady_step_ms=ms_of(r.steady_step_seconds), step_mode=r.step_mode.model_dump(),
                       precision=r.precision, compiled=r.compile_seconds is not None,
                       dollars_per_100k_steps=rate * 1e5 / per_s / 3600 if rate and per_s else None,
                       priced_as=priced_as, nvml_utilization=r.accelerator.utilization_percent, **res)


def ms_of(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def part_graph() -> None:
    """Deterministic kernels: the captured step replayed against the eager step, 100 steps of
    the default MLP with dropout on the split held on the device: the same weights, bit for bit."""
    n = ["train.max_steps=30", "train.batch_size=16"] if QUICK else ["train.max_steps=100"]
    out = {}
    for step in ("eager", "graph"):
        reset_determinism()
        r = trained(job("tabular", f"graph-identity-{step}", *n, f"train.step={step}", "model.dropout=0.1",
                        "train.loader.resident=true"))
        out[step] = {"sha256": r.model.sha256, "step_mode": r.step_mode.model_dump(), "history": history(r)}
    same = out["eager"]["sha256"] == out["graph"]["sha256"]
    record("graph", ok=same, bit_identical=same, **out)


def part_plan() -> None:
    """`retrain plan` for a one-H100 instance, against the step time measured here at the plan's
    micro-batch. The step count is kept so the priors can be fitted to it."""
    from training.config import InstancePrice
    from training.cost.hardware import GPUS
    from training.cost.roofline import PRIORS, _seconds, peak_flops
    from training.pipeline.plan_stage import plan_run

    steps = 6 if QUICK else 40
    for family in FAMILY:
        j = job(family, "plan")
        cfg = j.config
        cfg.cost.prices["h100-x1"] = InstancePrice(gpus=1, gpu="H100", vcpus=16, gpu_memory_gb=80,
                                                   on_demand_per_hour=4.0)
        reset_determinism()
        plan = plan_run(cfg, ["h100-x1"], None, calibration_steps=steps)
        row, c = plan.rows[0], plan.calibration
        model, task, batches = _real_batches(family, c.micro_batch)
        reset_determinism()
        count = c.step_costs.as_run
        peak, runs_in = peak_flops(GPUS["H100"], "auto")
        # Measured in the precision the prediction is for, not another.
        dtype = {"bf16": BF16, "fp16": torch.float16 if CUDA else None}.get(runs_in)
        measured = _step_time(model, task, batches, dtype, 3 if QUICK else 40)["step_s"]
        _, terms = _seconds(count, GPUS["H100"], 1, peak, PRIORS[1], 25.0, runs_in == "fp16")
        mid = row.step_seconds[1] if row.step_seconds else None
        record(f"plan_{family}", ok=mid is not None, micro_batch=c.micro_batch, predicted_s=row.step_seconds,
               source=row.step_source, measured_s=measured, loop_s=c.here.seconds_per_step,
               measured_over_predicted=measured / mid if mid else None, terms_mid=terms, runs_in=runs_in,
               measured_in=runs_in if dtype is not None else "fp32",
               count=count.model_dump())


def part_compile() -> None:
    """torch.compile warmed up as the trainer does it, then trained: graphs compiled after the
    first step (none is the goal), and the step time against eager."""
    import torch._dynamo.utils as dynamo_utils

    from training.model.network import forward_fn

    for name, family, micro, extra in (("transformer", "text", 16 if QUICK else 256, TRANSFORMER),
                                       ("mlp", "tabular", 64 if QUICK else 8192, MLP)):
        model, task, batches = _real_batches(family, micro, *extra)
        eager = _step_time(copy.deepcopy(model), task, batches, BF16, 3 if QUICK else 40)
        torch._dynamo.reset()
        dynamo_utils.counters.clear()
        compiled: Any = torch.compile(model)
        t0 = time.perf_counter()
        with torch.random.fork_rng(devices=[DEV] if CUDA else []):
            task.forward_loss(forward_fn(compiled, model), batches[0], DEV, BF16).backward()
        model.zero_grad(set_to_none=True)
        warm_s = time.perf_counter() - t0
        graphs = [dynamo_utils.counters["stats"]["unique_graphs"]]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True if CUDA else None)
        times = []
        for i in range((3 if QUICK else 40) + 5):
            sync()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            task.forward_loss(forward_fn(compiled, model), batches[i % len(batches)], DEV, BF16).backward()
            opt.step()
            sync()
            if i >= 5:
                times.append(time.perf_counter() - t0)
            graphs.append(dynamo_utils.counters["stats"]["unique_graphs"])
        times.sort()
        step = times[len(times) // 2]
        added = graphs[-1] - graphs[0]
        record(f"compile_{name}", ok=added == 0, warmup_compile_s=warm_s, graphs_after_each_step=graphs[:8],
               graphs_added_after_step_1=added, compiled_s=step, eager_s=eager["step_s"],
               speedup=eager["step_s"] / step, micro_batch=micro)


def part_autobatch() -> None:
    """train.auto_batch_size on real CUDA memory: the pick trains without running out, then the
    end-of-run fp32 re-timing runs at it; and a search whose budget is beyond the card stops at
    a real OutOfMemoryError and leaves no memory behind."""
    from training.model.network import forward_fn
    from training.trainer.precision import measure_fp32_slowdown
    from training.trainer.throughput import _rows, cuda_memory_budget, find_micro_batch

    model, task, batches = _real_batches("text", 16 if QUICK else 256, *TRANSFORMER)
    example = batches[0].map(lambda v: v.cpu())
    if CUDA:
        free, total = torch.cuda.mem_get_info(DEV)
        budget = cuda_memory_budget(free, torch.cuda.memory_reserved(DEV), total, 0.8)
    else:
        total = budget = 2 << 30
    # One step first: cuBLAS takes its workspace from the caching allocator at the first matmul
    # of a process (64 MiB on an H200), which is not the search's to give back.
    task.forward_loss(forward_fn(model), batches[0].map(lambda v: v[:1]), DEV, BF16).backward()
    model.zero_grad(set_to_none=True)
    base = torch.cuda.memory_allocated() if CUDA else 0
    s = find_micro_batch(model, task, 1 << 16, example, DEV, BF16, budget, max_seconds=10 if QUICK else 30)
    res: dict[str, Any] = {"budget": budget, "total": total, "micro": s.micro_batch, "accum": s.grad_accum,
                           "max_fitting": s.max_fitting, "probes": s.probes, "seconds": s.seconds,
                           "leaked_bytes": (torch.cuda.memory_allocated() if CUDA else 0) - base}
    rows = _rows(example, s.micro_batch).map(lambda v: v.to(DEV))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if CUDA:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    fits = True
    try:
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            task.forward_loss(forward_fn(model), rows, DEV, BF16).backward()
            opt.step()
        sync()
        res["real_steps_peak_bytes"] = torch.cuda.max_memory_allocated() if CUDA else None
    except torch.OutOfMemoryError as err:
        fits, res["real_steps"] = False, f"OutOfMemoryError: {str(err).splitlines()[0][:160]}"
    try:  # what the end of a run does next, with the optimizer state and gradients still held
        res["fp32_slowdown_at_auto_batch"] = measure_fp32_slowdown(model, task, rows, DEV, "bf16" if CUDA else "fp32",
                                                                   steps=1)
    except torch.OutOfMemoryError as err:
        fits, res["fp32_slowdown_at_auto_batch"] = False, f"OutOfMemoryError: {str(err).splitlines()[0][:160]}"
    del opt, rows
    if CUDA:
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        s2 = find_micro_batch(model, task, 1 << 22, example, DEV, BF16, 4 * total, max_seconds=30)
        torch.cuda.empty_cache()
        res["beyond_the_card"] = {"max_fitting": s2.max_fitting, "probes": s2.probes[-4:], "seconds": s2.seconds,
                                  "leaked_bytes": torch.cuda.memory_allocated() - base}
    record("autobatch", ok=fits and res["leaked_bytes"] <= 0, **res)


PARTS: dict[str, Callable[[], None]] = {
    "probes": part_probes, "prep": part_prep, "precision": part_precision, "resume": part_resume, "perf": part_perf,
    "graph": part_graph, "busy": part_busy, "plan": part_plan, "compile": part_compile, "autobatch": part_autobatch}


def main(part: str) -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        PARTS[part]()
    except Exception as err:  # noqa: BLE001 - a failed part is a finding; the parent goes on
        record(part, ok=False, error=f"{type(err).__name__}: {str(err).splitlines()[0][:400] if str(err) else ''}",
               trace=traceback.format_exc()[-3000:], seconds=time.perf_counter() - t0)


if __name__ == "__main__":
    main(sys.argv[1])
