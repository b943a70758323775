"""A warm start from the champion (`train.init_from: champion`): whether it can be honoured,
and the job's side of it: the champion's feature statistics, its vocabularies grown by this
dataset's new categories, the steps it trains and the segments that are new to it."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.config import RetrainConfig
from training.data.manifest import DatasetManifest
from training.data.prepare.features import (
    DERIVED_DIR,
    DERIVED_INDEX,
    FeatureStats,
    grown_for_warm_start,
    write_derived_arrays,
)
from training.model.package_meta import PackageMeta
from training.pipeline.handoffs import PackResult
from training.pipeline.step_budget import for_warm_start
from training.storage.files import write_atomic
from training.storage.root import StorageRoot

if TYPE_CHECKING:
    from training.registry.champion import Champion

__all__ = ["StartedWarm", "WarmStartPlan", "start_warm", "warm_start_plan", "warm_steps"]


@dataclass(frozen=True)
class WarmStartPlan:
    """The champion's weights (and the sha256 they must have) and its feature statistics."""

    weights: str
    sha256: str
    stats: FeatureStats


def warm_start_plan(config: RetrainConfig, champion: Champion | None,
                    manifest: DatasetManifest | None = None) -> tuple[WarmStartPlan | None, str]:
    """(champion weights + stats, reason) when `train.init_from: champion` can be honoured."""
    from training.model.compatibility import compatible, other_target
    if config.train.init_from != "champion":
        return None, "train.init_from is none"
    if champion is None:
        return None, "no champion yet: fresh start"
    if not champion.usable:
        return None, f"the champion is unusable ({champion.problem}): fresh start"
    package = champion.package
    meta = PackageMeta.read(package)
    if meta.architecture != config.model.model_dump(mode="json"):
        return None, "the champion's model config differs from model.*: fresh start"
    stats = meta.stats()
    if stats.numeric != config.data.numeric_features or stats.categorical != config.data.categorical or (
            manifest is not None and not compatible(stats, manifest)):
        return None, "the champion's feature columns differ from this run's data.* columns: fresh start"
    other = other_target(stats, manifest) if manifest is not None else None
    added = _added_classes(config, stats, manifest) if other is not None else []
    if other is not None and not added:
        return None, f"the champion predicts something else ({other}): fresh start"
    grown = f", its output layer grown by the new classes {added}" if added else ""
    return (
        WarmStartPlan(weights=str(package / "model.pt"), sha256=champion.sha256, stats=stats),
        f"warm start from champion {champion.sha256[:12]} with its feature statistics, its vocabularies grown "
        f"by this dataset's new categories{grown}",
    )


def _added_classes(config: RetrainConfig, stats: FeatureStats, manifest: DatasetManifest | None) -> list[Any]:
    """The classes this dataset adds to a multiclass champion's, when it only adds some (none
    dropped, same task and label): the built-in model's output layer grows by them, as its
    embeddings grow by new categories. Empty when the champion cannot be grown into this model."""
    from training.model.compatibility import other_target
    if (manifest is None or config.model.factory is not None or manifest.task != "multiclass"
            or other_target(stats, manifest, classes_may_differ=True) is not None):
        return []
    dataset = set(manifest.classes)
    if not set(stats.classes) < dataset:
        return []
    known = set(stats.classes)
    return [c for c in manifest.classes if c not in known]


@dataclass(frozen=True)
class StartedWarm:
    """What a warm start changes in the job: its config (the warm budget), the statistics it
    trains with, and what is new to the champion (segments, classes)."""

    config: RetrainConfig
    stats_path: Path
    new_segments: list[str] | None
    init_classes: list[Any] | None


def start_warm(config: RetrainConfig, warm: WarmStartPlan, packed: PackResult, manifest: DatasetManifest,
               root: StorageRoot) -> StartedWarm:
    """The champion's preprocessing for this dataset, written under the root once.

    Embedding rows and input scaling must mean what they meant for the champion: the
    warm-started model keeps the champion's preprocessing, its vocabularies grown by this
    dataset's new categories (the built-in model; a user's model keeps them as they are)."""
    stats = warm.stats
    init_classes = list(stats.classes) if stats.classes != manifest.classes else None
    seen = set(stats.segments)
    new_segments = [s.key for s in manifest.segments if s.key not in seen] if seen else None
    config = for_warm_start(config, warm_steps(config, manifest, stats))
    if config.model.factory is None:
        stats = grown_for_warm_start(stats, Path(packed.dataset_dir), manifest, config.preprocess)
    # Per dataset: the vocabularies, token ids and pixels depend on it.
    stats_path = root.path(f"preprocess/champion-{warm.sha256[:16]}-{packed.fingerprint[:16]}/feature_stats.json")
    # Derived from the champion and this dataset, so computed every time and compared: a file
    # already there (written by whoever can write the root) is used only when it holds this.
    data = (json.dumps(json.loads(stats.to_json()), indent=1, sort_keys=True) + "\n").encode()
    if not stats_path.is_file() or stats_path.read_bytes() != data:
        write_atomic(stats_path, data)
    _derive_for(Path(packed.dataset_dir), manifest, stats, stats_path.parent)
    return StartedWarm(config=config, stats_path=stats_path, new_segments=new_segments, init_classes=init_classes)


def warm_steps(config: RetrainConfig, manifest: DatasetManifest, champion: FeatureStats) -> int:
    """A warm start's optimizer steps: train.warm_steps, or scaled to the share of the train
    split that is new since the champion was trained (see its description). A champion whose
    statistics list no segments (fitted before segment datasets) counts as having seen nothing."""
    t = config.train.for_train_rows(manifest.train_rows)
    if t.warm_steps is not None:
        return t.warm_steps
    seen = set(champion.segments)
    new = sum(s.train_rows for s in manifest.segments if s.key not in seen) if manifest.segments else 0
    share = new / max(1, manifest.train_rows) if seen else 1.0
    return max(min(t.validate_every, t.max_steps), min(t.max_steps, math.ceil(3 * share * t.max_steps)))


def _derive_for(dataset_dir: Path, manifest: DatasetManifest, stats: FeatureStats, stats_dir: Path) -> None:
    """Token ids and pixels of this dataset under the champion's tokenizer and image size, for
    a warm start (training reads them stored, never tokenizes)."""
    if stats.derives and not (stats_dir / DERIVED_DIR / DERIVED_INDEX).exists():
        write_derived_arrays(dataset_dir, manifest, stats, stats_dir / DERIVED_DIR)
