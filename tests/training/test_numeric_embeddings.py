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
from training.data.validation import category_hash
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
