"""The description of one training job, and the fingerprint of what it computes.

Torch-free on purpose: the launcher, the worker's start-up and the stages read a job without
paying for the training loop's imports.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from training.config import RetrainConfig, fingerprint, fingerprinted
from training.storage.files import write_json_atomic

__all__ = ["TrainJob", "train_fingerprint"]


def train_fingerprint(config: RetrainConfig, device_type: str, precision: str) -> str:
    """What a run computes: the model and the train fields marked COMPUTED, and the numerics
    actually used. `precision: auto` means bf16 on one machine and fp32 on another, so the
    resolved precision and device type are part of it; the requested values are not."""
    parts: list[Any] = ["train", fingerprinted(config.model), fingerprinted(config.train),
                        {"device_type": device_type, "precision": precision}]
    if config.eval.metric is not None:
        parts.append({"eval.metric": config.eval.metric})  # it decides early stopping and the best step
    return fingerprint(*parts)


@dataclass
class TrainJob:
    """Everything the training process needs; JSON so it can cross a process boundary."""

    run_key: str
    run_dir: str
    dataset_dir: str
    stats_path: str
    config: RetrainConfig
    init_weights: str | None = None  # warm start: weights file of the champion
    init_sha256: str | None = None  # ... and the sha256 its weights must have
    new_segments: list[str] | None = None  # warm start: the segments new since the champion (mixed into every batch)
    init_classes: list[Any] | None = None  # warm start: the champion's classes, where this dataset adds some
    rate_per_hour: float = 0.0  # $/h of the machine, for budgets
    gpus: int = 0
    pre_train_seconds: float = 0.0  # pack + preprocess time of this run, counted against budgets
    champion_val_metric: float | None = None  # for the champion gate
    run_rel: str = ""  # run_dir relative to storage.root: where its objects go on S3
    pause_at: int | None = None  # tuning: stop with a checkpoint at this validated step (a rung)
    count_variants: bool = False  # plan's calibration: also count the bf16 and checkpointed steps (step_cost)
    numerics: list[str] | None = None  # (device type, precision) the run key was made for: the worker checks them

    @property
    def max_steps(self) -> int:
        """The run's effective step budget: a warm start's, a tuning trial's or a plan's
        calibration's is set once, on the job's own config; everything after reads it here."""
        return self.config.train.max_steps

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "config"}
        return {**data, "config": self.config.model_dump(mode="json")}

    def save(self, path: Path) -> None:
        write_json_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: Path) -> TrainJob:
        return TypeAdapter(cls).validate_json(path.read_bytes())
