"""Scoring: `retrain predict`'s path (Parquet read, validation, encoding, the package's
transform, the model, the output Parquet written) against a bare `model(x)` loop over the same
rows already transformed and in memory, in batches of the same size."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch

from benchmarks.common import demo_parquet, train_job
from training.trainer.run import train
from training.model.network import forward_fn
from training.model.batch_scoring import SCORE_BATCH, load_scoring_model, predict_files
from training.data.packing import FeatureValidator, feature_arrays
from training.config import DataConfig


def _bare_rows_per_s(scoring: Any, source: Path) -> float:
    """The floor: the model over pre-built tensors, nothing else."""
    stats = scoring.stats
    table = pq.read_table(source)
    validator = FeatureValidator(DataConfig(label=stats.label, numeric=stats.numeric, categorical=stats.categorical))
    transform = stats.transformer()
    batches = []
    for batch in table.to_batches(max_chunksize=SCORE_BATCH):
        arrays = transform.shard([feature_arrays(validator, source, batch, 0, [])], "")  # type: ignore[list-item]
        batches.append({k: torch.from_numpy(v) for k, v in arrays.items()})
    forward = forward_fn(scoring.model)
    t0 = time.perf_counter()
    with torch.no_grad():
        for batch in batches:
            forward(batch)
    return table.num_rows / (time.perf_counter() - t0)


def run(work: Path, rows: int = 1_000_000, rounds: int = 3) -> dict[str, Any]:
    source = demo_parquet(work, rows)
    job = train_job(work, "model", [f"data.source={source}", "train.max_steps=200", "train.eval_every=100"])
    package = Path(train(job).model.uri).parent
    scoring = load_scoring_model(package, None)
    scoring.model.eval()
    predict, bare = [], []
    for r in range(rounds):  # interleaved: drift on a shared box hits both
        out = work / f"scores-{r}.parquet"
        t0 = time.perf_counter()
        result = predict_files([source], scoring, out)
        predict.append(result.rows / (time.perf_counter() - t0))
        bare.append(_bare_rows_per_s(scoring, source))
    ratios = [p / b for p, b in zip(predict, bare, strict=True)]
    return {"rows": rows, "batch": SCORE_BATCH, "rounds": rounds, "torch_threads": torch.get_num_threads(),
            "predict_rows_per_s": [round(p) for p in predict], "bare_model_rows_per_s": [round(b) for b in bare],
            "ratio_predict_vs_bare_per_round": [round(x, 3) for x in ratios],
            "ratio_predict_vs_bare": round(statistics.median(ratios), 3)}
