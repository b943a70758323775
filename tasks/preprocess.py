from __future__ import annotations

from typing import cast

from prefect import task
from prefect.states import Completed, State

from tasks.policies import HOUR
from training.config import PreprocessConfig, RetrainConfig, StorageConfig
from training.data.prepare.features import PREPROCESS_VERSION
from training.pipeline.handoffs import PackResult, PrepResult
from training.pipeline.preprocess_stage import preprocess_stage

__all__ = ["fit_features", "preprocess_dataset", "PREPROCESS_VERSION"]


# No Prefect result persistence and no Prefect cache: Prefect stores results with cloudpickle, so
# anyone able to write the storage root could run code in the next run by replacing one. The
# statistics are content-addressed instead (preprocess/<key>/feature_stats.json, key = dataset
# fingerprint + preprocess config + code version) and checked against their sha256 before reuse;
# a reuse is reported as the state `Cached`, as a Prefect cache hit would be.
@task(name="preprocess", persist_result=False, timeout_seconds=6 * HOUR)
def fit_features(dataset_dir: str, preprocess: PreprocessConfig, storage: StorageConfig,
                 tags: dict[str, str] | None = None) -> State[PrepResult]:
    """Fit feature statistics on the train split, or reuse verified ones fitted before (on any
    machine sharing the root)."""
    prep = preprocess_stage(dataset_dir, preprocess, storage, tags)
    if prep.reused:
        return Completed(name="Cached", message=f"verified statistics {prep.key} reused", data=prep)
    return Completed(data=prep)


def preprocess_dataset(config: RetrainConfig, packed: PackResult) -> State[PrepResult]:
    """`fit_features` on a packed dataset with the config's preprocessing, storage and tags; its
    final state (named `Cached` on reuse). The task returns a state, which Prefect makes the task
    run's own: what comes back here is that state, not one wrapping it."""
    state = fit_features(packed.dataset_dir, config.preprocess, config.storage, dict(config.cost.tags), return_state=True)
    return cast("State[PrepResult]", state)
