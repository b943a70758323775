"""Whether a model package's feature statistics fit a dataset: the columns it reads, and the
label and classes it predicts. Torch-free: the flow's process decides warm starts and promotion
comparisons with it before any model is loaded."""

from __future__ import annotations

from typing import Any

from training.data.manifest import DatasetManifest
from training.data.prepare.features import FeatureStats

__all__ = ["compatible", "other_target", "shared_classes"]


def compatible(stats: FeatureStats, manifest: DatasetManifest) -> bool:
    """The package reads this dataset's columns (its feature statistics fit them)."""
    return (stats.numeric == manifest.numeric and stats.categorical == manifest.categorical
            and stats.vector == manifest.vector and stats.vector_dims == manifest.vector_dims
            and stats.text == manifest.text and stats.image == manifest.image)


def other_target(stats: FeatureStats, manifest: DatasetManifest, classes_may_differ: bool = False) -> str | None:
    """Why a model with these statistics predicts something else than this dataset's label
    (another task, label or set of classes), or None when it predicts the same thing.
    `classes_may_differ`: a multiclass model that shares at least two classes with the dataset
    predicts the same thing on their rows (classes grow in production), so it can be compared."""
    if stats.task != manifest.task:
        return f"it is a {stats.task} model and this run is {manifest.task}"
    if stats.label and stats.label != manifest.label:  # statistics written before labels were recorded: ""
        return f"it predicts label '{stats.label}' and this run predicts '{manifest.label}'"
    if stats.classes != manifest.classes and not (classes_may_differ and len(shared_classes(stats, manifest)) >= 2):
        return f"its classes {stats.classes} differ from this dataset's {manifest.classes}"
    return None


def shared_classes(stats: FeatureStats, manifest: DatasetManifest) -> list[Any]:
    """The dataset's classes that the model knows too, in the dataset's order."""
    known = set(stats.classes)
    return [c for c in manifest.classes if c in known]
