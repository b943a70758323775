"""The description of one training job, and the fingerprint of what it computes.

Torch-free on purpose: the launcher, the worker's start-up and the stages read a job without
paying for the training loop's imports.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from training.config import RetrainConfig, fingerprint, fingerprinted
from training.errors import ConfigError
from training.protocol.sealed import Sealed, seal
from training.storage.files import sha256_file

__all__ = ["JOB_FIELD_TRUST", "TrainJob", "train_fingerprint"]


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
    # The sha256 of what the paths above name, as the parent read it: the child reads those
    # files from the storage root, where another writer may have replaced them since.
    manifest_sha256: str | None = None  # dataset_dir/manifest.json
    stats_sha256: str | None = None  # stats_path
    derived_sha256: str | None = None  # the index of preprocessing's token ids and pixels beside stats_path

    @property
    def max_steps(self) -> int:
        """The run's effective step budget: a warm start's, a tuning trial's or a plan's
        calibration's is set once, on the job's own config; everything after reads it here."""
        return self.config.train.max_steps

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "config"}
        return {**data, "config": self.config.model_dump(mode="json")}

    def pin_inputs(self) -> None:
        """Pin the files of the root this job names by the sha256 of what they hold now (where
        the builder did not already): the manifest, the statistics and the derived arrays' index.
        The training process refuses them if they change before it reads them."""
        from training.data.prepare.features import DERIVED_DIR, DERIVED_INDEX

        def digest(path: Path) -> str | None:
            return sha256_file(path) if path.is_file() else None

        stats = Path(self.stats_path) if self.stats_path else None
        if self.manifest_sha256 is None and self.dataset_dir:
            self.manifest_sha256 = digest(Path(self.dataset_dir) / "manifest.json")
        if stats is not None and self.stats_sha256 is None:
            self.stats_sha256 = digest(stats)
        if stats is not None and self.derived_sha256 is None:
            self.derived_sha256 = digest(stats.parent / DERIVED_DIR / DERIVED_INDEX)

    def seal(self, path: Path) -> Sealed:
        """Written to `path` (a record of what the run began with) and sealed: the child gets
        the digest from its parent and reads nothing from a file that does not match it."""
        return seal(path, (json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n").encode())

    @classmethod
    def unseal(cls, sealed: Sealed) -> TrainJob:
        data = sealed.read("the training job")
        try:
            return TypeAdapter(cls).validate_json(data)
        except ValidationError as err:
            raise ConfigError(f"the training job {sealed.path} is not one this version writes: "
                              f"{str(err).splitlines()[0]}; run the same command again") from None


# Why each field of a job can be trusted by the process that trains it. A job reaches a child
# sealed by its parent (`training.protocol.sealed`): the parent built every field, and the seal
# proves the file is the parent's. A node of a multi-node run gets the seal's digest on its
# command line from the launcher (TorchX's app, never the root), and its key besides. A path
# names a file of the storage root, which the seal cannot vouch for: each is read against the
# digest of its content carried beside it. `tests/training/protocol/test_job_trust.py` fails
# when a field is added without an entry here.
SEALED = "set by the parent; the seal's sha256 reaches the child outside the root"
JOB_FIELD_TRUST: dict[str, str] = {
    "run_key": "keyed: a node recomputes it from the config, dataset and numerics and refuses a mismatch",
    "run_dir": SEALED + "; a node rebases it inside its own working copy of the root",
    "dataset_dir": "digest: manifest_sha256 (the manifest the parent read); its shards by the manifest's sha256s",
    "stats_path": "digest: stats_sha256; the token ids and pixels beside it by derived_sha256 (their index, "
                  "which holds each array's sha256)",
    "config": "keyed (the fields marked COMPUTED) and " + SEALED,
    "init_weights": "digest: init_sha256 (the champion's weights, checked before loading)",
    "init_sha256": "keyed: part of the run key",
    "new_segments": SEALED + "; each must be a segment of the sealed manifest",
    "init_classes": SEALED,
    "rate_per_hour": SEALED + " (the price table of the flow's config)",
    "gpus": SEALED,
    "pre_train_seconds": SEALED,
    "champion_val_metric": SEALED,
    "run_rel": SEALED,
    "pause_at": SEALED,
    "count_variants": SEALED,
    "numerics": "keyed: part of the run key; the worker refuses other numerics than its own",
    "manifest_sha256": SEALED,
    "stats_sha256": SEALED,
    "derived_sha256": SEALED,
}
