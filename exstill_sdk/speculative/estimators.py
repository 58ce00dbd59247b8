"""The estimators that choosing K rests on, written once: acceptance by drafted position,
moving averages, and least-squares lines. Adaptive K (one sequence), batch K (a batch sharing a
pass) and the measured profiles (exstill-bench profile) use these.

Pure Python on purpose: the K planners run every round, and on a target whose step costs a few
hundred microseconds numpy's per-call overhead on arrays of nine numbers would show.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple


class PositionAcceptance:
    """Counts of drafted positions reached and accepted: position j (1-based) is reached when
    every drafted token before it was accepted. Halving the counts lets an estimate follow text
    that changes."""

    __slots__ = ("accepted", "reached")

    def __init__(self, max_k: int) -> None:
        self.reached = [0.0] * (max_k + 1)
        self.accepted = [0.0] * (max_k + 1)

    def observe(self, k: int, accepted: int) -> None:
        """A draft of ``k`` tokens of which the first ``accepted`` were accepted."""
        reached, hits = self.reached, self.accepted
        for j in range(1, min(k, accepted + 1, len(reached) - 1) + 1):
            reached[j] += 1
            hits[j] += j <= accepted

    def halve(self) -> None:
        self.reached = [r * 0.5 for r in self.reached]
        self.accepted = [a * 0.5 for a in self.accepted]

    def rate(self, j: int, prior: float, weight: float) -> float:
        """Acceptance at position j, the counts joined by ``prior`` worth ``weight`` drafts."""
        return (self.accepted[j] + prior * weight) / (self.reached[j] + weight)

    def rates(self, prior: float, weight: float) -> list[float]:
        """``rate`` at positions 1..max_k (index j - 1)."""
        return [self.rate(j, prior, weight) for j in range(1, len(self.reached))]

    def rates_given(self, prior: list[float], weight: float) -> list[float]:
        """Acceptance at positions 1..max_k (index j - 1) from these counts, one text's, given
        ``prior`` (the rates over every text): position j's counts are joined by ``weight``
        drafts of prior[j - 1] moved toward the rate this text gave at the positions above j.
        A position the text rarely reached is taken to be like the ones above it in this text,
        and, until the text has shown anything, like the same position in every text."""
        rates = []
        hits = reached = 0.0
        for j in range(1, len(self.reached)):
            expected = (prior[j - 1] * weight + hits) / (weight + reached)
            rates.append(self.rate(j, expected, weight))
            hits += self.accepted[j]
            reached += self.reached[j]
        return rates


class MovingAverage:
    """The mean of the last about ``window`` samples: the plain mean until there are that many,
    then an exponential average with weight 1 / window. ``update(value, samples)`` takes the
    mean of several samples at once."""

    __slots__ = ("count", "value", "window")

    def __init__(self, window: int) -> None:
        self.window = window
        self.count = 0
        self.value = 0.0

    def update(self, value: float, samples: int = 1) -> None:
        self.count += samples
        weight = min(1.0, samples / min(self.count, self.window))
        self.value += (value - self.value) * weight


class Line(NamedTuple):
    """y = intercept + slope * x."""

    intercept: float
    slope: float

    def __call__(self, x: float) -> float:
        return self.intercept + self.slope * x


def fit_line(points: Iterable[tuple[float, float, float]], min_slope: float | None = 0.0) -> Line:
    """The weighted least-squares line through (x, y, weight) points, its slope at least
    ``min_slope`` (None: any); flat through their mean when the points span one x."""
    pts = list(points)
    total = sum(w for _, _, w in pts)
    mx = sum(x * w for x, _, w in pts) / total
    my = sum(y * w for _, y, w in pts) / total
    spread = sum(w * (x - mx) ** 2 for x, _, w in pts)
    if not spread:
        return Line(my, 0.0)
    slope = sum(w * (x - mx) * (y - my) for x, y, w in pts) / spread
    if min_slope is not None:
        slope = max(min_slope, slope)
    return Line(my - slope * mx, slope)
