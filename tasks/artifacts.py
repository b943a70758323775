"""Prefect UI artifacts built from the small dicts the stages return."""

from __future__ import annotations

from typing import Any

from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.context import TaskRunContext

__all__ = ["publish_promotion"]


def _in_run() -> bool:
    return TaskRunContext.get() is not None  # .fn() calls in tests run outside any Prefect run


def publish_promotion(evaluation: dict[str, Any]) -> None:
    if not _in_run():
        return
    promo = evaluation["promotion"]
    challenger = evaluation["metrics"]
    champion = promo.get("champion_metrics") or {}
    rows = [
        {"model": "challenger", "sha256": promo["challenger_sha256"][:16],
         **{k: round(challenger[k], 5) for k in ("auc", "logloss", "accuracy")}},
    ]
    if promo.get("champion_sha256"):
        rows.append({"model": "champion", "sha256": promo["champion_sha256"][:16],
                     **{k: round(champion[k], 5) if k in champion else None for k in ("auc", "logloss", "accuracy")}})
    create_table_artifact(rows, key="champion-challenger", description="Test-split metrics of challenger and champion")
    verdict = "PROMOTED" if promo["promoted"] else "champion kept"
    note = f"\n\n_{promo['champion_note']}_" if promo.get("champion_note") else ""
    create_markdown_artifact(
        f"### {verdict}\n\n{promo['reason']}{note}\n\n"
        f"target AUC: {evaluation['target_auc']} (met: {evaluation['target_met']})",
        key="promotion-decision",
        description="Champion/challenger decision",
    )
