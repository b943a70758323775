"""The cost levers on a model where they matter: a 6-block text transformer (over 10M
parameters) reading a few million tokens through the real pack and preprocess steps.

Each figure is a ratio within this run:
- activation memory (what autograd keeps for backward) with gradient checkpointing / without;
- the automatic batch size under `train.simulated_memory_mb`, with checkpointing / without;
- step time with checkpointing / without (the recompute's cost);
- step time with `torch.compile` / eager (compile time reported apart).
On a CPU these are CPU figures; the README gives the GPU expectations with their sources.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from training.data.batch import Batch
from training.config import load_config
from training.data.prepare.features import DERIVED_DIR, fit_feature_stats
from training.data.load.loader import ShardBatches
from training.data.ingest.packing import pack_local
from training.model.network import ModelSchema
from training.model.spec import build_model
from training.model.objectives import Task
from training.trainer.throughput import find_micro_batch, step_memory_bytes

DOCS = 24_000
WORDS_PER_DOC = 160  # every document fills max_tokens: eager and compiled steps see the same length
MAX_TOKENS = 128
BATCH = 16
STEPS = 12
MODEL = ["model.text_dim=384", "model.text_layers=6", "model.text_heads=6", "model.hidden=[]"]


def _documents(path: Path) -> Path:
    rng = np.random.default_rng(0)
    words = np.array([f"w{i}" for i in range(6000)])
    # Zipf-like word frequencies, as in text: common words become whole tokens, rare ones split.
    weights = 1.0 / np.arange(1, len(words) + 1)
    draws = rng.choice(words, (DOCS, WORDS_PER_DOC), p=weights / weights.sum())
    docs = [" ".join(row) for row in draws]
    label = (rng.random(DOCS) < 0.5).astype(np.int8)
    pq.write_table(pa.table({"doc": pa.array(docs), "y": pa.array(label)}), path, row_group_size=4000)
    return path


def _steps(model: torch.nn.Module, task: Task, batches: list[Batch]) -> float:
    """Median seconds of a forward, backward and AdamW step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for batch in batches:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        task.loss(model(batch), batch["label"]).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(work: Path) -> dict[str, Any]:
    source = _documents(work / "docs.parquet")
    config = load_config(overrides=[f"data.source={source}", "data.label=y", "data.text=[doc]", "data.numeric=[]",
                                    "data.categorical=[]", f"preprocess.max_tokens={MAX_TOKENS}", *MODEL])
    t0 = time.perf_counter()
    dataset_dir, manifest, _ = pack_local(source, config.data, work / "datasets")
    stats_path, stats = fit_feature_stats(dataset_dir, manifest, config.preprocess, work / "preprocess")
    prep_seconds = time.perf_counter() - t0
    loader = ShardBatches(dataset_dir, manifest, "train", BATCH, stats.transformer(stats_path.parent / DERIVED_DIR))
    tokens = int(sum(int(loader.batch(0, i)["ntok"].sum()) for i in range(loader.batches_per_epoch)))
    batches = [loader.batch(0, i) for i in range(STEPS + 2)]
    task = Task.of(stats)
    schema = ModelSchema.of(stats)
    torch.manual_seed(0)
    plain = build_model(config.model, schema)
    params = sum(p.numel() for p in plain.parameters())
    ckpt = build_model(config.model.model_copy(update={"gradient_checkpointing": True}), schema)
    ckpt.load_state_dict(plain.state_dict())
    cpu = torch.device("cpu")

    memory = {name: step_memory_bytes(m, task, BATCH, batches[0], cpu, None) for name, m in
              (("plain", plain), ("ckpt", ckpt))}
    activations = {name: memory[name] - 4 * 4 * params for name in memory}  # less weights, grads, AdamW moments
    budget_mb = 512
    searches = {name: find_micro_batch(m, task, 4096, batches[0], cpu, None, budget_mb << 20)
                for name, m in (("plain", plain), ("ckpt", ckpt))}
    auto = {name: search.max_fitting for name, search in searches.items()}

    eager = _steps(plain, task, batches[2:])
    recompute = _steps(ckpt, task, batches[2:])
    compiled: Any = torch.compile(build_model(config.model, schema))
    t0 = time.perf_counter()
    _steps(compiled, task, batches[:2])  # the first steps compile (forward and backward graphs)
    compile_seconds = time.perf_counter() - t0
    compiled_step = _steps(compiled, task, batches[2:])
    return {
        "parameters": params,
        "train tokens (after tokenizing)": tokens,
        "pack + tokenizer fit + stored token ids (s)": round(prep_seconds, 1),
        "activation bytes per step, no checkpointing (batch 16 x 128 tokens)": activations["plain"],
        "activation ratio: checkpointing / none": round(activations["ckpt"] / activations["plain"], 3),
        f"auto batch size under simulated_memory_mb={budget_mb}, no checkpointing": auto["plain"],
        f"auto batch size under simulated_memory_mb={budget_mb}, checkpointing": auto["ckpt"],
        "auto batch ratio: checkpointing / none": round(auto["ckpt"] / auto["plain"], 2),
        "auto batch searches (probes, s), none / checkpointing": [
            (len(s.probes), round(s.seconds, 1)) for s in (searches["plain"], searches["ckpt"])],
        "step time ratio: checkpointing / none": round(recompute / eager, 3),
        "step time ratio: torch.compile / eager": round(compiled_step / eager, 3),
        "eager step (s, batch 16)": round(eager, 3),
        "compile time of the first steps (s)": round(compile_seconds, 1),
    }
