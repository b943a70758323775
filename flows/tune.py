"""The tuning study: pack -> preprocess (shared by every trial) -> trials (rungs as task runs,
pruned by successive halving, within the budget) -> report -> optionally the best trial through
the champion/challenger gate."""

from __future__ import annotations

from prefect import flow

from tasks.pack import pack_dataset
from tasks.policies import FLOW_TIMEOUTS, apply_credentials_block
from tasks.preprocess import preprocess_dataset
from tasks.runtime import checked_columns, effective_config, flow_run_name, one_writer_per_root
from tasks.trials import promote_best, run_study
from training.config import RetrainConfig

__all__ = ["tune"]


@flow(name="tune", timeout_seconds=FLOW_TIMEOUTS.tune, flow_run_name=flow_run_name, log_prints=True)
def tune(config: RetrainConfig = RetrainConfig()) -> str:  # noqa: B008 - pydantic default renders in the UI
    """Search tune.space within the budget; returns the path of tune_report.json.

    Args:
        config: The run to tune (its tune section: the space, pruner and budget); merged key by
            key over the deployment's config.
    """
    config = effective_config(config)
    apply_credentials_block(config.storage)
    config = checked_columns(config)
    with one_writer_per_root(config.storage):
        packed = pack_dataset(config)
        prep = preprocess_dataset(config, packed).result()
        report, report_path = run_study(config, packed, prep)
        if config.tune.promote and report.best is not None:
            promote_best(config, packed, prep, report)
        return report_path
