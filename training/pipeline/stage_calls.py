"""The stages' work that needs torch, asked of a child process (`training.launch.calls`): the
challenger's evaluation and promotion (scoring, the paired comparison, torch.export), and the
champion gate's validation metric. The flow's process calls `evaluate_in_child`,
`champion_metric_in_child` and `compare_in_child`; the child (`training.worker.stage`) answers
the request they write.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Callable, Literal, Union

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

__all__ = ["DIFFERENCE", "METRIC", "REQUEST", "ChampionMetricRequest", "CompareRequest", "EvaluateRequest",
           "PrecisionRequest", "StageRequest", "champion_metric_in_child", "compare_in_child", "evaluate_in_child",
           "precision_in_child"]


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


class CompareRequest(_Request):
    call: Literal["compare"] = "compare"
    challenger: str  # model package folders
    base: str


StageRequest = Union[EvaluateRequest, ChampionMetricRequest, CompareRequest, PrecisionRequest]
REQUEST: TypeAdapter[StageRequest] = TypeAdapter(Annotated[StageRequest, Field(discriminator="call")])
METRIC: TypeAdapter[float | None] = TypeAdapter(float | None)
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
