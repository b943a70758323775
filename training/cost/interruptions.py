"""How often spot capacity is taken back, per instance type and region, as AWS publishes it.

AWS's Spot Instance Advisor gives each (region, instance type) a band of the fraction of its
spot instances interrupted over the past month: <5 %, 5-10 %, 10-15 %, 15-20 %, >20 %. Source of
the shipped bands: the advisor's feed (spot-bid-advisor.s3.amazonaws.com/spot-advisor-data.json,
Linux) as snapshotted in github.com/alexei-led/spotinfo, `internal/spot/data/
spot-advisor-data.json` at commit 5eedf20 (committed 2025-06-28). Bands move month to month:
set `interruption_band` on a `cost.prices` entry to override one, or `cost.region` to read
another region's.

A band is read as a constant hazard over the month (730 h): a monthly interruption fraction p is
an hourly rate -ln(1 - p) / 730. The open-ended >20 % band is taken as 20-50 %, an assumption.
GCP and Azure publish no such bands: their instances use
`train.checkpoint.mean_seconds_between_preemptions`.
"""

from __future__ import annotations

import math

__all__ = ["BANDS", "INTERRUPTION_SOURCE", "SPOT_BANDS", "hourly_rates"]

HOURS_PER_MONTH = 730.0
INTERRUPTION_SOURCE = ("AWS Spot Instance Advisor feed, Linux, as snapshotted in github.com/alexei-led/spotinfo "
                       "internal/spot/data/spot-advisor-data.json @ 5eedf20 (2025-06-28)")
# Band label -> (low, high) monthly interruption fraction.
BANDS: dict[str, tuple[float, float]] = {
    "<5%": (0.0, 0.05), "5-10%": (0.05, 0.10), "10-15%": (0.10, 0.15), "15-20%": (0.15, 0.20), ">20%": (0.20, 0.50)}

SPOT_BANDS: dict[str, dict[str, str]] = {
    "us-east-1": {"g4dn.xlarge": "15-20%", "g5.xlarge": ">20%", "g5.12xlarge": ">20%", "p3.2xlarge": ">20%",
                  "p3.8xlarge": ">20%", "p4d.24xlarge": "10-15%", "p5.48xlarge": ">20%"},
    "us-west-2": {"g4dn.xlarge": ">20%", "g5.xlarge": ">20%", "g5.12xlarge": ">20%", "p3.2xlarge": ">20%",
                  "p3.8xlarge": ">20%", "p4d.24xlarge": ">20%", "p5.48xlarge": "5-10%"},
    "eu-west-1": {"g4dn.xlarge": "5-10%", "g5.xlarge": "10-15%", "g5.12xlarge": ">20%", "p3.2xlarge": ">20%",
                  "p3.8xlarge": ">20%", "p4d.24xlarge": ">20%"},
}


def _rate(fraction: float) -> float:
    return -math.log1p(-fraction) / HOURS_PER_MONTH


def hourly_rates(band: str) -> tuple[float, float, float]:
    """(low, middle, high) interruptions per hour of one instance in `band`."""
    low, high = BANDS[band]
    return _rate(low), _rate((low + high) / 2), _rate(high)
