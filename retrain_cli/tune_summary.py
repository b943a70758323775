"""The terminal summary of `retrain tune`, from tune_report.json."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported by the CLI at start-up; the report (and Optuna) only once a study ran
    from training.tune.study_report import TuneReport



__all__ = ["tune_summary"]


_BUDGET_NAMES = {"max_usd": ("$", ""), "max_gpu_hours": ("", " GPU-h"), "max_wall_seconds": ("", " s wall")}


def tune_summary(report: TuneReport, path: str) -> str:
    metric = report.metric
    keys = sorted({k for t in report.trials for k in t.params})
    lines = [f"study {report.study}: {report.status}, {len(report.trials)} trials, rungs {report.rungs}"
             + (f" ({report.stop_reason})" if report.stop_reason else "")]
    header = ["trial", "state", "steps", metric, "cost $", *keys]
    rows = [[str(t.number), t.state, str(t.steps), "-" if t.value is None else f"{t.value:.4f}", f"{t.usd:.6f}",
             *(_short(t.params.get(k)) for k in keys)] for t in report.trials]
    lines += _aligned(header, rows, right={0, 2, 3, 4})
    spend, naive = report.spend, report.naive
    lines.append(f"  spent       ${spend.usd:.6f}, {spend.gpu_hours:.6f} GPU-h, {spend.seconds:.1f} machine-s"
                 f" on {report.instance_type} ({report.market}); budget {_budget(report.budget.limits())}")
    saved = report.saved_fraction
    cut = any(t.state in ("pruned", "budget") for t in report.trials)
    lines.append(f"  naive       every trial until its own early stopping, with the same seed retrains, on "
                 f"{report.market}: ${naive.usd:.6f}, {naive.seconds:.1f} machine-s"
                 + (f" (saved {saved:.0%})" if saved is not None else
                    " (no trial cut: no saving claimed)" if not cut and report.best is not None else
                    " (no model yet: no saving claimed)"))
    if spend.seed_seconds:
        more = max((len(t.seed_values) for t in report.trials), default=0)
        lines.append(f"  seeds       the best trials retrained with {more} more seeds: {spend.seed_seconds:.1f} "
                     "machine-s of the spend")
    if report.seeds_skipped:
        lines.append(f"  seeds       not retrained: {report.seeds_skipped}")
    best = report.best
    if best is None:
        lines.append("  best        no trial reached full fidelity")
    else:
        chosen = ", ".join(f"{k}={_short(v)}" for k, v in best.params.items())
        lines.append(f"  best        trial {best.trial}: val {metric} {best.value:.4f} ({chosen})")
        if best.score is not None:
            over = f"the mean over {best.seeds} seeds" if best.seeds > 1 else "one seed"
            lines.append(f"              ranked by its last validation, {over}: {best.score:.4f}")
        if best.evidence:
            lines.append(f"              {best.evidence}")
        lines.append(f"  config      {best.config} (retrain run --config <it>)")
    gate = report.gate
    if gate is not None:
        first = " (the config as given went through first: the root had no champion)" if gate.base_first else ""
        lines.append(f"  champion    {'PROMOTED' if gate.promoted else 'kept'} trial {gate.trial}{first}: {gate.reason}")
        lines.append(f"              {gate.report}")
    lines.append(path)
    return "\n".join(lines)


def _aligned(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    """Columns as wide as their widest cell, two spaces apart; numbers right-aligned."""
    widths = [max([len(header[i]), *(len(r[i]) for r in rows)]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  " + "  ".join(c.rjust(w) if i in right else c.ljust(w)
                                for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    return [line(header), *(line(r) for r in rows)]


def _budget(limits: dict[str, float]) -> str:
    if not limits:
        return "none"
    return ", ".join(f"{_BUDGET_NAMES.get(k, ('', ' ' + k))[0]}{v:g}{_BUDGET_NAMES.get(k, ('', ' ' + k))[1]}"
                     for k, v in limits.items())


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
