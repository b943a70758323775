"""The stage child: `python -m training.worker.stage REQUEST.json#sha256=HEX ERROR.json PARENT_PID RESULT.json`
answers one request of `training.pipeline.stage_calls` (evaluation, promotion, the champion
gate's metric, a comparison). Exit codes: 0 done, EXIT_USER_ERROR with the error in ERROR.json;
warnings go to the parent as `log` events, as the training worker's do.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from training.errors import EXIT_USER_ERROR, RetrainError, StorageError
from training.pipeline.stage_calls import (
    DIFFERENCE,
    METRIC,
    CHAMPION,
    REQUEST,
    SCORES,
    ChampionRequest,
    ChampionScoresRequest,
    CompareRequest,
    EvaluateRequest,
    PrecisionRequest,
    SpaceFitRequest,
    StageRequest,
)
from training.protocol.events import ErrorReport
from training.protocol.sealed import Sealed
from training.storage.files import write_atomic
from training.worker.io import die_with_parent, forward_logs, report_error

__all__ = ["main"]


def _run(request: StageRequest) -> str:
    from training.pipeline.evaluate_stage import champion_validation_metric, compare_on_validation, evaluate_stage
    from training.pipeline.precision_pick import measure_precision

    if isinstance(request, PrecisionRequest):
        return measure_precision(request.config, request.packed, request.prep).model_dump_json()
    if isinstance(request, ChampionScoresRequest):
        from training.pipeline.decide_stage import champion_scores

        return SCORES.dump_json(champion_scores(request.config, request.packed, Path(request.package),
                                                request.meta_sha256, request.keys)).decode()
    if isinstance(request, ChampionRequest):
        from training.registry.champion import champion_of

        return CHAMPION.dump_json(champion_of(request.config)).decode()
    if isinstance(request, SpaceFitRequest):
        from training.tune.driver import check_space_fits

        check_space_fits(request.config, request.prep)
        return "null"
    if isinstance(request, EvaluateRequest):
        return evaluate_stage(request.config, request.packed, request.trained).model_dump_json()
    if isinstance(request, CompareRequest):
        return DIFFERENCE.dump_json(compare_on_validation(request.config, request.packed, Path(request.challenger),
                                                          Path(request.base))).decode()
    return METRIC.dump_json(champion_validation_metric(request.config, request.packed)).decode()


def _report(error_path: Path, report: ErrorReport) -> int:
    report_error(error_path, report)
    return EXIT_USER_ERROR


def main(argv: list[str]) -> int:
    request_arg, error_path, parent, result_path = argv[0], Path(argv[1]), int(argv[2]), Path(argv[3])
    forward_logs()
    die_with_parent()  # the work is idempotent: the parent's retry does it again
    if os.getppid() != parent:
        return 1  # the parent went before this process could watch for it
    try:
        result = _run(REQUEST.validate_json(Sealed.parse(request_arg).read("the stage's request")))
    except StorageError as err:
        return _report(error_path, ErrorReport(type=type(err).__name__, message=str(err), transient=err.transient))
    except RetrainError as err:
        return _report(error_path, ErrorReport(type=type(err).__name__, message=str(err)))
    except (ConnectionError, TimeoutError) as err:
        # A network failure that nothing below named: the retry policy treats it as transient.
        return _report(error_path, ErrorReport(type="StorageError", message=f"{type(err).__name__}: {err}",
                                               transient=True))
    write_atomic(result_path, result.encode())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
