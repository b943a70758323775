"""Expected hours, restarts and the chance of meeting a deadline on a market that takes
machines back.

Interruptions are a Poisson process at the instance's hourly rate. The run checkpoints every
Young/Daly interval tau = sqrt(2 C / rate) (C: one checkpoint's stall), so each interruption loses
on average half an interval plus a restart R. The expected wall time T solves
T = W (1 + C / tau) + rate * T * (R + tau / 2), W being the work without interruptions.
"""

from __future__ import annotations

import math

from pydantic import BaseModel

__all__ = ["SpotOutlook", "spot_outlook", "young_daly_seconds"]


class SpotOutlook(BaseModel):
    hours: float  # expected wall time, checkpoint stalls and interruptions included
    interruptions: float  # expected count
    lost_hours: float  # expected work redone plus restarts
    checkpoint_every_seconds: float | None  # the Young/Daly interval (None: no interruptions expected)
    p_deadline: float | None  # chance the run ends by the deadline


def young_daly_seconds(save_seconds: float, rate_per_hour: float) -> float:
    return math.sqrt(2 * max(save_seconds, 1e-3) * 3600.0 / rate_per_hour)


def _poisson_cdf(k: int, mean: float) -> float:
    if k < 0:
        return 0.0
    term = total = math.exp(-mean)
    for i in range(1, k + 1):
        term *= mean / i
        total += term
    return min(1.0, total)


def spot_outlook(work_hours: float, rate_per_hour: float, save_seconds: float, restart_seconds: float,
                 deadline_hours: float | None) -> SpotOutlook:
    """The expected run of `work_hours` of work at `rate_per_hour` interruptions (0: on demand)."""
    if rate_per_hour <= 0:
        met = None if deadline_hours is None else float(work_hours <= deadline_hours)
        return SpotOutlook(hours=work_hours, interruptions=0.0, lost_hours=0.0, checkpoint_every_seconds=None,
                           p_deadline=met)
    tau = young_daly_seconds(save_seconds, rate_per_hour)
    stalled = work_hours * (1 + save_seconds / tau)
    per_interruption = (restart_seconds + tau / 2) / 3600.0
    room = 1 - rate_per_hour * per_interruption
    hours = stalled / room if room > 0 else math.inf
    p = None
    if deadline_hours is not None:
        # Each interruption costs per_interruption on average; the ones that fit before the deadline.
        allowed = math.floor((deadline_hours - stalled) / per_interruption) if deadline_hours >= stalled else -1
        p = _poisson_cdf(allowed, rate_per_hour * min(hours, deadline_hours))
    return SpotOutlook(hours=hours, interruptions=rate_per_hour * hours, lost_hours=hours - stalled,
                       checkpoint_every_seconds=tau, p_deadline=p)
