"""Builds a ready-to-train job from a config, through the same stage functions the flow uses."""

from __future__ import annotations

from training.config import RetrainConfig
from training.job import TrainJob
from training.storage_root import StorageRoot
from training.stages import pack_stage, preprocess_stage, run_key_for


def make_job(config: RetrainConfig, run_name: str | None = None) -> TrainJob:
    packed = pack_stage(config)
    prep = preprocess_stage(packed.dataset_dir, config.preprocess.model_dump(mode="json"), config.storage.root,
                            config.storage.model_dump(mode="json"), config.cost.tags)
    run_key = run_key_for(config, packed.fingerprint)
    root = StorageRoot.from_config(config)
    rel = f"runs/{run_name or run_key}"
    return TrainJob(
        run_key=run_key,
        run_dir=str(root.local / rel),
        run_rel=rel if root.is_remote else "",
        dataset_dir=packed.dataset_dir,
        stats_path=prep.stats_path,
        config=config,
    )
