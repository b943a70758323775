"""The terminal summary of `retrain tune`, from tune_report.json."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported by the CLI at start-up; the report (and Optuna) only once a study ran
    from training.tune.study_report import TuneReport



__all__ = ["tune_summary"]


def tune_summary(report: TuneReport, path: str) -> str:
    metric, priced = report.metric, report.rate_per_hour > 0
    keys = sorted({k for t in report.trials for k in t.params})
    lines = [f"study {report.study}: {report.status}, {len(report.trials)} trials, rungs {report.rungs}"
             + (f" ({report.stop_reason})" if report.stop_reason else "")]
    lines.append(f"  {'trial':>5}  {'state':<13}{'steps':>7}  {metric:>8}  {'cost $':>10}  " + "  ".join(keys))
    for t in report.trials:
        value = "-" if t.value is None else f"{t.value:.4f}"
        lines.append(f"  {t.number:>5}  {t.state:<13}{t.steps:>7}  {value:>8}  {t.usd:>10.6f}  "
                     + "  ".join(_short(t.params.get(k)) for k in keys))
    spend, naive = report.spend, report.naive
    lines.append(f"  spent       ${spend.usd:.6f}, {spend.gpu_hours:.6f} GPU-h, {spend.seconds:.1f} machine-s"
                 f" on {report.instance_type} ({report.market}); budget {report.budget.limits() or 'none'}")
    saved = report.saved_fraction
    lines.append(f"  naive       every trial to full fidelity, on demand: ${naive.usd:.6f}"
                 + (f" (saved {saved:.0%})" if saved is not None and priced else ""))
    best = report.best
    if best is None:
        lines.append("  best        no trial reached full fidelity")
    else:
        lines.append(f"  best        trial {best.trial}: val {metric} {best.value:.4f} {best.params}")
        lines.append(f"  config      {best.config} (retrain run --config <it>)")
    lines.append(path)
    return "\n".join(lines)


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
