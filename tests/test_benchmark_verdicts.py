"""The benchmarks page's verdicts: "met" only beyond the noise, none for a stale figure, and a
word when its rows come from different machines."""

from __future__ import annotations

from typing import Any

from benchmarks.headlines import HEADLINES, Headline
from benchmarks.provenance import code_sha

HEADLINE = Headline("figure", "checkpoint", "idle", "loaded", 0.3, True, "reference", fair=True)


def test_met_only_beyond_the_noise_and_never_when_stale() -> None:
    assert HEADLINE.met(0.2) == "met" and HEADLINE.met(0.4) == "not met"
    assert HEADLINE.met(0.25, noise=0.1) == "within noise" and HEADLINE.met(0.1, noise=0.1) == "met"
    assert HEADLINE.met(0.1, stale=True).startswith("stale") and HEADLINE.met(None, stale=True) == "not measured"


def _result(stem: str, machine: str, current: bool) -> dict[str, Any]:
    return {"machine": f"2 cores, {machine}, no GPU, Python 3.11", "code_sha": code_sha(stem) if current else "old",
            "date": "2026-12-01", "idle": 0.1}


def test_the_summary_names_each_rows_machine_and_withholds_stale_verdicts() -> None:
    from docs.generate import _headlines

    stems = list(dict.fromkeys(h.result for h in HEADLINES))
    results = {stem: _result(stem, "AMD EPYC" if i % 2 else "Intel Xeon", current=i == 0) for i, stem in enumerate(stems)}
    for stem, result in results.items():
        for h in HEADLINES:
            if h.result == stem:
                result[h.idle] = 0.0 if h.at_most else 10.0  # far past every target
    page = "\n".join(_headlines(results))
    rows = [line for line in page.splitlines() if line.startswith("| ") and "](#" in line]
    current = [r for r in rows if f"](#{stems[0]})" in r]
    assert current and all("(met" in r and "stale" not in r for r in current)
    stale = [r for r in rows if f"](#{stems[0]})" not in r]
    assert stale and all("stale: no verdict" in r and "(met" not in r for r in stale)
    assert all("on 2 cores, " in r for r in rows)
    assert "These rows come from different machines" in page
