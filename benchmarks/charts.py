"""The benchmarks page's chart: each headline figure's rounds, idle and beside a one-core burner,
against its target, drawn as SVG from the result files (`docs/generate.py` writes it and checks it
is current, so the chart cannot drift from the figures in the table)."""

from __future__ import annotations

import io
import textwrap
from typing import Any

from benchmarks.headlines import HEADLINES, Headline
from benchmarks.provenance import code_sha

__all__ = ["summary_svg"]

COLOURS = {"met": "#2e7d32", "not met": "#c62828", "within noise": "#ef8f00"}
UNJUDGED = "#757575"  # a figure whose reference is not yet a fair one


def _rounds(result: dict[str, Any], key: str | None) -> list[float]:
    values = result.get(key) if key else None
    return [float(v) for v in values] if isinstance(values, list) else []


def is_stale(stem: str, result: dict[str, Any]) -> bool:
    """The code `stem` measures changed since `result` was recorded (or it names no hash)."""
    return result.get("code_sha") != code_sha(stem)


def _panel(ax: Any, headline: Headline, result: dict[str, Any]) -> None:
    conditions = (("idle", headline.idle, headline.idle_rounds), ("loaded", headline.loaded, headline.loaded_rounds))
    shown = [headline.target]
    for x, (condition, key, rounds_key) in enumerate(conditions):
        value = result.get(key) if key else None
        if value is None:
            continue
        rounds = _rounds(result, rounds_key)
        shown += [float(value), *rounds]
        noise = result.get(dict(headline.noise).get(condition, ""))
        colour = COLOURS.get(headline.met(value, noise, stale=is_stale(headline.result, result)), UNJUDGED)
        # Rounds spread evenly across the slot (no random jitter: the SVG must be reproducible).
        offsets = [(i - (len(rounds) - 1) / 2) * 0.06 for i in range(len(rounds))]
        ax.scatter([x + o for o in offsets], rounds, s=14, color=colour, alpha=0.45, linewidths=0, zorder=2)
        ax.hlines(value, x - 0.28, x + 0.28, color=colour, linewidth=2.5, zorder=3)
        ax.annotate(f"{value:.3g}", (x + 0.3, value), va="center", fontsize=8, color=colour)
    ax.axhline(headline.target, color="#424242", linestyle="--", linewidth=1, zorder=1)
    ax.annotate(f"target {'≤' if headline.at_most else '≥'} {headline.target:g}", (1.5, headline.target),
                xytext=(0, 3), textcoords="offset points", ha="right", va="bottom", fontsize=7, color="#424242")
    ax.set_xticks([0, 1], ["idle", "beside a burner"], fontsize=8)
    ax.set_xlim(-0.6, 1.6)
    low, high = min(shown), max(shown)
    pad = 0.12 * ((high - low) or abs(high) or 1.0)
    ax.set_ylim(low - pad, high + pad)  # the target always in view, with room for its label
    ax.tick_params(axis="y", labelsize=8)
    ax.set_title("\n".join(textwrap.wrap(headline.figure, 30)), fontsize=9)


def summary_svg(results: dict[str, dict[str, Any]]) -> str:
    """One panel per headline: its rounds as dots, the median as a bar coloured met (green), not
    met (red) or not judged (grey), and the target as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Text as text and fixed element ids: the same figures give the same bytes on any machine.
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "retrain-benchmarks",
                                "font.family": "sans-serif"}):
        columns = 3
        rows = -(-len(HEADLINES) // columns)
        fig, axes = plt.subplots(rows, columns, figsize=(3.3 * columns, 2.9 * rows), squeeze=False)
        for ax, headline in zip(axes.flat, HEADLINES, strict=False):  # spare panels are hidden below
            _panel(ax, headline, results.get(headline.result, {}))
        for ax in list(axes.flat)[len(HEADLINES):]:
            ax.set_visible(False)
        fig.tight_layout()
        out = io.StringIO()
        fig.savefig(out, format="svg", metadata={"Date": None, "Creator": None})
        plt.close(fig)
    return out.getvalue()
