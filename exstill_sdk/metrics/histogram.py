"""A histogram of seconds with fixed buckets, cheap enough to observe every round.

prometheus_client's own Histogram takes a lock and walks its buckets on every observation; a
round observes one value, so this keeps plain counts (one bisect, one increment) and the
collectors turn them into Prometheus' cumulative buckets at scrape time.
"""

from __future__ import annotations

from bisect import bisect_left

ROUND_TRIP_BUCKETS = (
    50e-6,
    100e-6,
    200e-6,
    500e-6,
    1e-3,
    2e-3,
    5e-3,
    10e-3,
    20e-3,
    50e-3,
    100e-3,
    250e-3,
    1.0,
)
"""Upper bounds (seconds) for a card's round trip: a hit over USB is tens of microseconds, a
miss a draft's compute, a reconnect up to a second or more."""


class Histogram:
    """Counts of observations by bucket (each ``<=`` its upper bound, as Prometheus counts),
    and their sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...] = ROUND_TRIP_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, float]]:
        """Prometheus' buckets: (upper bound, observations at or below it), +Inf last."""
        out, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), float(total)))
        return out
