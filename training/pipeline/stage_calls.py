"""The stages' work that needs torch, asked of a child process (`training.launch.calls`): the
challenger's evaluation and promotion (scoring, the paired comparison, torch.export), and the
champion gate's validation metric. The flow's process calls `evaluate_in_child`,
`champion_metric_in_child` and `compare_in_child`; the child (`training.worker.stage`) answers
the request they write.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Callable, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from training.config import RetrainConfig
from training.launch.calls import call_in_child
from training.launch.process import log_child_event
from training.pipeline.handoffs import Evaluation, PackResult, PrepResult
from training.protocol.entries import STAGE_CHILD_MODULE
from training.protocol.events import ChildEvent
from training.protocol.numerics import PrecisionPick
from training.protocol.results import TrainResult
from training.model.paired import PairedDifference
from training.registry.champion import Champion

__all__ = ["DIFFERENCE", "METRIC", "REQUEST", "ChampionMetricRequest", "CompareRequest", "EvaluateRequest",
           "ChampionScoresRequest", "PrecisionRequest", "SCORES", "SpaceFitRequest", "StageRequest",
           "CHAMPION", "ChampionRequest", "champion_in_child", "champion_metric_in_child", "champion_scores_in_child", "compare_in_child", "evaluate_in_child",
           "precision_in_child", "space_fit_in_child"]


class _Request(BaseModel):
    model_config = ConfigDict(frozen=True)

    config: RetrainConfig
    packed: PackResult


class EvaluateRequest(_Request):
    call: Literal["evaluate"] = "evaluate"
    trained: TrainResult


class ChampionMetricRequest(_Request):
    call: Literal["champion_metric"] = "champion_metric"


class PrecisionRequest(_Request):
    call: Literal["precision"] = "precision"
    prep: PrepResult


class ChampionScoresRequest(_Request):
    call: Literal["champion_scores"] = "champion_scores"
    package: str  # the champion's package folder
    meta_sha256: str | None  # its model.json's, from the champion pointer
    keys: list[str]  # the segments to score it on


class ChampionRequest(BaseModel):
    model_config = ConfigDict(frozen=True)

    call: Literal["champion"] = "champion"
    config: RetrainConfig


class SpaceFitRequest(_Request):
    call: Literal["space_fit"] = "space_fit"
    prep: PrepResult


class CompareRequest(_Request):
    call: Literal["compare"] = "compare"
    challenger: str  # model package folders
    base: str


StageRequest = Union[EvaluateRequest, ChampionMetricRequest, CompareRequest, PrecisionRequest, ChampionScoresRequest,
                     SpaceFitRequest, ChampionRequest]
REQUEST: TypeAdapter[StageRequest] = TypeAdapter(Annotated[StageRequest, Field(discriminator="call")])
METRIC: TypeAdapter[float | None] = TypeAdapter(float | None)
SCORES: TypeAdapter[dict[str, float]] = TypeAdapter(dict[str, float])
CHAMPION: TypeAdapter[Champion | None] = TypeAdapter(Optional[Champion])
DIFFERENCE: TypeAdapter[PairedDifference] = TypeAdapter(PairedDifference)


def evaluate_in_child(config: RetrainConfig, packed: PackResult, trained: TrainResult,
                      on_event: Callable[[ChildEvent], None] = log_child_event) -> Evaluation:
    """`evaluate_stage`, run in a child process."""
    text = call_in_child(STAGE_CHILD_MODULE, EvaluateRequest(config=config, packed=packed, trained=trained),
                         "the evaluation", on_event)
    return Evaluation.model_validate_json(text)


def champion_metric_in_child(config: RetrainConfig, packed: PackResult,
                             on_event: Callable[[ChildEvent], None] = log_child_event) -> float | None:
    """`champion_validation_metric`, run in a child process."""
    text = call_in_child(STAGE_CHILD_MODULE, ChampionMetricRequest(config=config, packed=packed),
                         "the champion gate's evaluation", on_event)
    return METRIC.validate_json(text)


def compare_in_child(config: RetrainConfig, packed: PackResult, challenger: Path, base: Path,
                     on_event: Callable[[ChildEvent], None] = log_child_event) -> PairedDifference:
    """`compare_on_validation`, run in a child process."""
    text = call_in_child(STAGE_CHILD_MODULE, CompareRequest(config=config, packed=packed, challenger=str(challenger),
                                                            base=str(base)), "the comparison with the base", on_event)
    return DIFFERENCE.validate_json(text)




def precision_in_child(config: RetrainConfig, packed: PackResult, prep: PrepResult,
                       on_event: Callable[[ChildEvent], None] = log_child_event) -> PrecisionPick:
    """`measure_precision` (train.precision auto on a GPU), run in a child process."""
    text = call_in_child(STAGE_CHILD_MODULE, PrecisionRequest(config=config, packed=packed, prep=prep),
                         "the precision measurement", on_event)
    return PrecisionPick.model_validate_json(text)


def champion_scores_in_child(config: RetrainConfig, packed: PackResult, package: str, meta_sha256: str | None,
                             keys: list[str], on_event: Callable[[ChildEvent], None] = log_child_event
                             ) -> dict[str, float]:
    """`decide_stage.champion_scores` (train.retrain_when: drift or degraded), in a child process."""
    text = call_in_child(STAGE_CHILD_MODULE, ChampionScoresRequest(config=config, packed=packed, package=package,
                                                                   meta_sha256=meta_sha256, keys=keys),
                         "the champion's scoring on the new rows", on_event)
    return SCORES.validate_json(text)


def space_fit_in_child(config: RetrainConfig, packed: PackResult, prep: PrepResult,
                       on_event: Callable[[ChildEvent], None] = log_child_event) -> None:
    """`tune.driver.check_space_fits` (the largest model a tuning space can sample fits this
    machine), in a child process; its ConfigError crosses as one."""
    call_in_child(STAGE_CHILD_MODULE, SpaceFitRequest(config=config, packed=packed, prep=prep),
                  "the tuning space's memory check", on_event)


def champion_in_child(config: RetrainConfig, on_event: Callable[[ChildEvent], None] = log_child_event
                      ) -> Champion | None:
    """`registry.champion.champion_of` (the champion, verified file by file and loaded), in a
    child process: loading a package needs torch, which the flow's process never imports. The
    package's files are where the child verified them, in this machine's working copy."""
    return CHAMPION.validate_json(call_in_child(STAGE_CHILD_MODULE, ChampionRequest(config=config),
                                                "the champion's check", on_event))
