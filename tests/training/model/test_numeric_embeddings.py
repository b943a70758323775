"""`model.numeric_embedding: periodic`: rtdl-num-embeddings' PeriodicEmbeddings in front of the
MLP. It trains, resumes bit-identically, and the portable export scores as predict does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from tests.training.helpers import assert_resumes_bit_identically, make_job
from training.config import RetrainConfig
from training.data.manifest import require_manifest
from training.data.ingest.validation import category_hash
from training.model.evaluation import evaluate_package
from training.trainer.run import train


def _periodic(config: RetrainConfig) -> RetrainConfig:
    config.model.numeric_embedding = "periodic"
    config.model.numeric_embedding_dim = 8
    return config


def test_periodic_embeddings_train_and_the_export_scores_as_predict(small_config: RetrainConfig,
                                                                    tmp_path: Path) -> None:
    from rtdl_num_embeddings import PeriodicEmbeddings

    from training.model.batch_scoring import load_scoring_model, predict_files
    from training.model.export import export_portable

    config = _periodic(small_config)
    config.train.max_steps = 200
    job = make_job(config)
    train(job)
    package = Path(job.run_dir) / "model"
    scores = evaluate_package(package, Path(job.dataset_dir), require_manifest(Path(job.dataset_dir)), None)
    assert scores["auc"] > 0.7  # the demo's Bayes-optimal AUC is about 0.82; a constant scores 0.5
    scoring = load_scoring_model(package, None)
    assert isinstance(scoring.model.numeric_embedding, PeriodicEmbeddings)

    source = Path(config.data.source or "")
    rows = pq.read_table(source).slice(0, 300)
    pq.write_table(rows, tmp_path / "rows.parquet")
    predicted = pq.read_table(predict_files([tmp_path / "rows.parquet"], scoring, tmp_path / "s.parquet").output)
    export_portable(package, scoring.model, scoring.stats)
    program = torch.export.load(str(package / "export" / "model.pt2")).module()
    stats = scoring.stats
    num = torch.tensor(np.stack([rows.column(c).to_numpy().astype(np.float32) for c in stats.numeric], axis=1))
    cat = torch.from_numpy(np.stack([category_hash(rows.column(c).combine_chunks()) for c in stats.categorical], axis=1))
    with torch.no_grad():
        exported = program(num, cat).numpy()
    np.testing.assert_allclose(exported, predicted.column("probability").to_numpy(), atol=1e-6)


def test_periodic_embeddings_resume_bit_identically(small_config: RetrainConfig) -> None:
    assert_resumes_bit_identically(_periodic(small_config), stop_at=20)


def test_piecewise_scoring_path_agrees_with_rtdls_encoding() -> None:
    """Columns of several bin counts (one bin, two, many), values below, on and above every edge:
    the by-bin lookup used without gradients gives rtdl's output to float rounding."""
    from rtdl_num_embeddings import PiecewiseLinearEmbeddings

    from training.model.piecewise import PiecewiseLinear

    torch.manual_seed(0)
    bins = [torch.tensor([-1.0, 2.0]), torch.tensor([-2.0, 0.0, 3.0]), torch.sort(torch.randn(49) * 2).values,
            torch.tensor([0.0, 0.5, 1.0, 4.0])]
    ours, theirs = PiecewiseLinear(bins, 8), PiecewiseLinearEmbeddings(bins, 8, activation=False, version="B")
    for p in ours.parameters():  # rtdl starts the piecewise part at zero: give it weights to check
        torch.nn.init.normal_(p)
    theirs.load_state_dict(ours.state_dict())
    on_edges = torch.stack([torch.cat([b, b[:1] - 1, b[-1:] + 1]).repeat(60)[:60] for b in bins], dim=1)
    x = torch.cat([torch.randn(500, 4) * 4, on_edges])
    with torch.no_grad():
        fast, reference = ours(x), theirs(x)
    torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-5)
    assert set(ours.state_dict()) == set(theirs.state_dict())
    with torch.enable_grad():  # training keeps rtdl's own path, and its backward
        torch.testing.assert_close(ours(x), reference, rtol=0, atol=0)


def test_piecewise_scoring_path_calls_no_op_that_deterministic_cuda_refuses() -> None:
    """Validation and scoring run the by-bin lookup under `train.deterministic` (the default),
    where `torch.use_deterministic_algorithms(True)` makes CUDA raise on a floating cumsum, among
    others. The lookup must use none of them, or the default run dies at its first validation."""
    from torch.overrides import TorchFunctionMode

    from training.model.piecewise import PiecewiseLinear

    refused_on_cuda = {"cumsum", "cumsum_", "index_add", "index_add_", "scatter_add", "scatter_add_", "put_",
                       "index_put_", "bincount", "histc", "kthvalue", "median"}
    called: set[str] = set()

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            called.add(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    bins = [torch.tensor([-1.0, 0.0, 2.0, 5.0]), torch.tensor([0.0, 1.0])]
    layer = PiecewiseLinear(bins, 4)
    with torch.no_grad(), Record():
        layer(torch.randn(16, 2))
    assert called and not called & refused_on_cuda, called & refused_on_cuda
