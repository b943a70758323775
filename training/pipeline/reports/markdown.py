"""The human report: curves as a PNG and a Markdown page, written next to report.json.

The same Markdown is published as a Prefect artifact, so a run without a Prefect UI has the
same report as a file.
"""

from __future__ import annotations

import base64
import math
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI imports `savings` without the report's models
    from training.cost.bill import CostReport
    from training.cost.utilization import Utilization
    from training.pipeline.reports.run_report import RunReport
    from training.protocol.results import Validation
    from training.registry.tracking import TrackingNotes

__all__ = ["render_curves", "render_markdown"]


def _label(metric: str) -> str:
    return {"auc": "AUC", "logloss": "log loss", "macro_f1": "macro F1", "rmse": "RMSE", "mae": "MAE",
            "r2": "R²"}.get(metric, metric)


def render_curves(history: list[Validation], out: Path, metric: str = "auc") -> Path | None:
    """Training loss (and validation log loss, for classifiers) and the validation value of
    the chosen metric against steps; None when there is no history."""
    if not history:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    steps = [v.step for v in history]
    fig, (loss_ax, auc_ax) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=100)
    loss_ax.plot(steps, [v.train_loss for v in history], marker="o", label="train loss (last batch)")
    if "logloss" in history[0].metrics:
        loss_ax.plot(steps, [v["logloss"] for v in history], marker="o", label="validation log loss")
    loss_ax.set_xlabel("step")
    loss_ax.set_title("loss")
    loss_ax.legend()
    auc_ax.plot(steps, [v[metric] for v in history], marker="o", color="tab:green")
    auc_ax.set_xlabel("step")
    auc_ax.set_title(f"validation {_label(metric)}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    fig.savefig(tmp, format="png")
    plt.close(fig)
    tmp.replace(out)
    return out


def _usd(x: float) -> str:
    return f"${x:,.4f}" if x < 1 else f"${x:,.2f}"


def savings(usd: float, against: str) -> str:
    """"saved $x against ...", or what the run cost more, with the digits that show it (a run
    on the CPU costs fractions of a cent); the same within float rounding (an on-demand run
    against the naive on-demand run)."""
    if abs(usd) < 1e-7:
        return f"cost the same as {against}"
    amount = _usd(abs(usd)) if abs(usd) >= 1e-4 else f"${abs(usd):.{1 - math.floor(math.log10(abs(usd)))}f}"
    return f"saved {amount} against {against}" if usd > 0 else f"cost {amount} more than {against}"


def render_markdown(report: RunReport, curves: Path | None, embed: bool = True) -> str:
    lines = [*_summary_lines(report), *_cost_lines(report.cost), *_time_lines(report.utilization),
             *_tracking_lines(report.tracking)]
    metric = report.metric
    if curves is not None:
        lines.append("## Curves")
        lines.append("")
        if embed:
            data = base64.b64encode(curves.read_bytes()).decode()
            lines.append(f"![loss and validation {_label(metric)}](data:image/png;base64,{data})")
        else:
            lines.append(f"![loss and validation {_label(metric)}]({curves.name})")
        lines.append("")
        lines.append(f"Curves: `{curves}`")
    return "\n".join(lines) + "\n"


def _summary_lines(report: RunReport) -> list[str]:
    m, metric = report.metrics, report.metric
    others = ", ".join(f"{_label(k)} {v:.4f}" for k, v in m.items() if k != metric)
    lines = [
        f"# Retrain run `{report.run_key}`: {report.status}",
        "",
        f"{report.steps} steps of {report.task} training; test {_label(metric)} **{m[metric]:.4f}**, {others}.",
    ]
    if report.stop_reason:
        lines.append(f"Stopped: {report.stop_reason}.")
    verdict = "promoted" if report.promotion.promoted else "champion kept"
    return [*lines, "", f"Promotion: **{verdict}**: {report.promotion.reason}.", ""]


def _cost_lines(cost: CostReport) -> list[str]:
    naive, restart = cost.naive, cost.naive_restarting
    return [
        "## Cost",
        "",
        f"{cost.where()} at {_usd(cost.rate_per_hour)}/h.",
        "",
        "| | this run | naive run: on-demand, fp32, no early stop, never preempted | naive run on this "
        "market: fp32, no early stop, no checkpoints, so each of this run's preemptions restarts it from zero |",
        "|---|---|---|---|",
        f"| compute | {_usd(cost.compute.usd)} | {_usd(naive.usd)} | {_usd(restart.usd)} |",
        f"| GPU-hours | {cost.compute.gpu_hours:.4f} | {naive.gpu_hours:.4f} | {restart.gpu_hours:.4f} |",
        f"| seconds | {cost.compute.billed_seconds:.1f} | {naive.seconds:.1f} | {restart.seconds:.1f} |",
        f"| storage (no checkpoints for the naive runs) | {_usd(cost.storage.total_usd)} | "
        f"{_usd(naive.storage_usd)} | {_usd(restart.storage_usd)} |",
        f"| total | {_usd(cost.total_usd)} | {_usd(naive.total_usd)} | {_usd(restart.total_usd)} |",
        "",
        f"This run {savings(cost.savings_usd, 'the naive on-demand run')}, and "
        f"{savings(cost.savings_vs_restarting_usd, 'the naive run on this market')}."
        + (" The naive runs' fp32 steps are priced at this run's step time: set train.measure_fp32 to time them."
           if naive.fp32_slowdown is None else ""),
        "",
        "| stage | $ |",
        "|---|---|",
        *[f"| {k} | {_usd(v)} |" for k, v in cost.compute.per_stage_usd.items()],
        "",
    ]


def _time_lines(util: Utilization) -> list[str]:
    fractions = dict(util.fractions.items())
    return [
        "## Where the time went",
        "",
        f"**{util.verdict}**: {util.advice}.",
        "",
        "| | seconds | share |",
        "|---|---|---|",
        *[f"| {k} | {v:.2f} | {fractions[k]:.1%} |" for k, v in util.seconds.items()],
        "",
        f"{util.samples_per_second:,.0f} samples/s; data-stall fraction {util.data_stall_fraction:.1%}.",
        "",
    ]


def _tracking_lines(tracking: TrackingNotes | None) -> list[str]:
    """The MLflow section: where the run is, and what was not recorded and why."""
    if tracking is None:
        return []
    lines = ["## MLflow", ""]
    if tracking.run_id:
        aliases = ", ".join(tracking.aliases) or "none"
        lines.append(f"Run `{tracking.run_id}` at {tracking.uri}"
                     + (f"; model version {tracking.model_version} (aliases: {aliases})."
                        if tracking.model_version else "."))
    if tracking.problems:
        lines += ["", "Not recorded:", "", *[f"- {p}" for p in tracking.problems]]
    return lines + [""]
