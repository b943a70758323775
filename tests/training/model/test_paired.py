"""The paired interval of two models' difference on the same rows."""

from __future__ import annotations

import numpy as np

from training.model.paired import paired_difference


def _two_models(rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    y = rng.normal(size=rows)
    return y, y + rng.normal(scale=1.0, size=rows), y + rng.normal(scale=1.1, size=rows)


def test_a_bootstrap_at_the_usual_confidence_reads_its_bounds_from_the_draws() -> None:
    y, a, b = _two_models(300)
    usual = paired_difference("regression", "rmse", y, a, b, 0.95)
    assert usual.method.startswith("paired bootstrap,") and usual.low < usual.improvement < usual.high


def test_a_confidence_too_high_for_the_draws_tails_takes_the_normal_interval_and_is_wider() -> None:
    """The best of 40 trials is judged at 1 - 0.05/40: 2,000 draws hold about one draw beyond
    each bound, so a quantile would be the extreme draw, whatever it happened to be."""
    y, a, b = _two_models(300)
    usual = paired_difference("regression", "rmse", y, a, b, 0.95)
    strict = paired_difference("regression", "rmse", y, a, b, 1 - 0.05 / 40)
    assert "normal interval" in strict.method and strict.improvement == usual.improvement
    assert strict.low < usual.low and strict.high > usual.high
    # The same draws' spread: the two intervals' half-widths are in the ratio of their z values.
    ratio = (strict.high - strict.low) / (usual.high - usual.low)
    assert 1.4 < ratio < 1.9  # z(0.999375) / z(0.975) = 3.23 / 1.96 = 1.65, up to the percentile's own noise
