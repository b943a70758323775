"""Scoring: `retrain predict`'s path (Parquet read, validation, encoding, the package's
transform, the model, the output Parquet written) against a bare `model(x)` loop over the same
rows already transformed and in memory, in batches of the same size, both on the torch thread
count predict's policy picks on this machine. Predict runs the model in `torch.inference_mode`;
the bare loop runs under `torch.no_grad` (as such loops are usually written) and, as the floor,
in `torch.inference_mode` too. Idle, then beside a process spinning on one core (`loaded_`);
each ratio is the median of the per-round ratios.

Where its CPU goes: the CPU seconds predict takes (every thread of its process) over the bare
loop's, per round, and the cores predict kept busy while it ran (its CPU seconds over its wall
seconds). Its reading and writing threads overlap the model only as far as there are cores for
them: with the bare loop's single thread on one core, the speed ratio is about the cores used
over the CPU ratio.

And the command's fixed cost: `retrain predict` on a 100-row file from a fresh process, beside
`python -c "import torch"`, the floor any scoring command pays."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pyarrow.parquet as pq
import torch

from benchmarks.common import demo_parquet, outside_load, train_job
from training.data.batch import Batch
from training.protocol.results import TrainResult
from training.trainer.run import train
from training.model.network import forward_fn
from training.model.batch_scoring import SCORE_BATCH, load_scoring_model, predict_files
from training.data.ingest.validation import FeatureValidator, feature_arrays
from training.config import DataConfig, RetrainConfig
from training.pipeline.predict_stage import scoring_threads


Batches = list[Batch]


def _bare_batches(scoring: Any, source: Path) -> Batches:
    """The rows transformed and in memory once, in the scoring batch size."""
    stats = scoring.stats
    table = pq.read_table(source)
    validator = FeatureValidator(DataConfig(label=stats.label, numeric=stats.numeric, categorical=stats.categorical))
    transform = stats.transformer()
    batches = []
    for batch in table.to_batches(max_chunksize=SCORE_BATCH):
        batches.append(transform.shard([feature_arrays(validator, source, batch, 0, [])], "").map(torch.from_numpy))
    return batches


def _bare_rows_per_s(scoring: Any, batches: Batches, rows: int, mode: Callable[[], Any]) -> tuple[float, float]:
    """The floor: the model over pre-built tensors, nothing else, under `mode` (`torch.no_grad`
    as a hand-written loop is usually written, or `torch.inference_mode`, the fastest); its rows
    per second and the CPU seconds it took (every thread of this process)."""
    forward = forward_fn(scoring.model)
    t0, c0 = time.perf_counter(), time.process_time()
    with mode():
        for batch in batches:
            forward(batch)
    return rows / (time.perf_counter() - t0), time.process_time() - c0


def _wall(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t0


def _fixed_cost(work: Path, source: Path, package: Path, rounds: int) -> dict[str, Any]:
    small = work / "hundred.parquet"
    pq.write_table(pq.read_table(source).slice(0, 100), small)
    cli, floor = [], []
    for r in range(rounds):  # interleaved
        out = work / f"hundred-scores-{r}.parquet"
        cli.append(_wall([sys.executable, "-m", "retrain_cli.main", "predict", "--input", str(small), "--output",
                          str(out), "--model", str(package), "--set", f"storage.root={work / 'root'}"]))
        floor.append(_wall([sys.executable, "-c", "import torch"]))
    return {"cli_100_rows_seconds": [round(x, 3) for x in cli], "import_torch_seconds": [round(x, 3) for x in floor],
            "cli_fixed_cost_seconds": round(statistics.median(cli), 3),
            "cli_fixed_cost_beyond_import_torch_seconds": round(statistics.median(cli) - statistics.median(floor), 3)}


def run(work: Path, rows: int = 1_000_000, rounds: int = 5) -> dict[str, Any]:
    source = demo_parquet(work, rows)
    job = train_job(work, "model", [f"data.source={source}", "train.max_steps=200", "train.eval_every=100"])
    result = train(job)
    assert isinstance(result, TrainResult), result
    package = Path(result.model.uri).parent
    scoring = load_scoring_model(package, None)
    scoring.model.eval()
    batches = _bare_batches(scoring, source)

    def bare_pair() -> tuple[tuple[float, float], tuple[float, float]]:
        return (_bare_rows_per_s(scoring, batches, rows, torch.no_grad),
                _bare_rows_per_s(scoring, batches, rows, torch.inference_mode))

    def rounds_of(tag: str) -> dict[str, Any]:
        predict, bare, floor, cpu, cores = [], [], [], [], []
        with scoring_threads(RetrainConfig()) as threads:  # both sides on predict's thread count
            for r in range(rounds):
                # Each predict run is bracketed by bare loops, and its references are their means: a
                # shared box drifts by 10-30 % within a minute, and bracketing cancels a linear drift.
                before = bare_pair()
                out = work / f"scores-{tag}-{r}.parquet"
                t0, c0 = time.perf_counter(), time.process_time()
                result = predict_files([source], scoring, out)
                wall = time.perf_counter() - t0
                predict.append(result.rows / wall)
                predict_cpu = time.process_time() - c0
                cores.append(predict_cpu / wall)
                after = bare_pair()
                bare.append((before[0][0] + after[0][0]) / 2)
                floor.append((before[1][0] + after[1][0]) / 2)
                # CPU per row, predict's over the bare loop's: what the read, checks, transform and
                # write add to the model's work. With one core free, no overlap can hide it.
                cpu.append(predict_cpu / ((before[0][1] + after[0][1]) / 2))
        ratios = [p / b for p, b in zip(predict, bare, strict=True)]
        floor_ratios = [p / b for p, b in zip(predict, floor, strict=True)]
        prefix = "" if tag == "idle" else f"{tag}_"
        return {f"{prefix}torch_threads": threads,
                f"{prefix}predict_rows_per_s": [round(p) for p in predict],
                f"{prefix}bare_model_rows_per_s": [round(b) for b in bare],
                f"{prefix}ratio_predict_vs_bare_per_round": [round(x, 3) for x in ratios],
                f"{prefix}ratio_predict_vs_bare": round(statistics.median(ratios), 3),
                f"{prefix}bare_inference_mode_rows_per_s": [round(b) for b in floor],
                f"{prefix}ratio_predict_vs_bare_inference_mode_per_round": [round(x, 3) for x in floor_ratios],
                f"{prefix}ratio_predict_vs_bare_inference_mode": round(statistics.median(floor_ratios), 3),
                f"{prefix}cpu_predict_over_bare_per_round": [round(x, 3) for x in cpu],
                f"{prefix}cpu_predict_over_bare": round(statistics.median(cpu), 3),
                f"{prefix}predict_cores_used_per_round": [round(x, 2) for x in cores],
                f"{prefix}predict_cores_used": round(statistics.median(cores), 2)}

    idle = rounds_of("idle")
    with outside_load(True):
        time.sleep(1.0)  # the burner is busy before predict's thread policy looks at the load
        loaded = rounds_of("loaded")
    return {"rows": rows, "batch": SCORE_BATCH, "rounds": rounds, **idle, **loaded,
            **_fixed_cost(work, source, package, rounds)}
