"""Choosing K, the number of tokens to draft next, per stream.

``FixedK(k)`` always asks for k. ``AdaptiveK`` picks, each round, the K that maximises
expected emitted tokens per second of round time, from measurements of this stream:

    E[tokens](K) = 1 + sum_{i=1..K} prod_{j=1..i} a_j
    T(K)         = c + d * K + v(K + 1)
    K*           = argmax_{1 <= K <= max_k} E[tokens](K) / T(K)

where a_j is the measured probability that drafted position j is accepted given that all
before it were (counts with an optimistic prior of 0.8 worth two rounds, so that positions not
yet tried look worth trying), d is the measured card wait per drafted token (near
0 when prefetch answers at once), v(n) is the target's verify time for n tokens (a least-squares
line through the measured (n, seconds) of the last rounds), and c is the rest of a round's host
time. Every 8th round it tries K*+1, so that positions beyond K* keep being measured, and
four rounds later K*-1, so that the verify line always has more than one n to fit (a stream that
always drafts the same K would otherwise see verification cost nothing per token).
"""

from __future__ import annotations

from collections import deque

import numpy as np

PRIOR = 0.8
PRIOR_WEIGHT = 2.0


class FixedK:
    def __init__(self, k: int) -> None:
        self.k = k

    def choose(self, max_k: int) -> int:
        return min(self.k, max_k)

    def observe(
        self, k: int, accepted: int, card_wait_s: float, verify_s: float, other_s: float
    ) -> None:
        pass


class AdaptiveK:
    EXPLORE_EVERY = 8
    HISTORY = 64

    def __init__(self, max_k: int = 8, initial: int | None = None) -> None:
        self.max_k = max_k
        # With nothing measured yet the prior (acceptance 0.8 everywhere) and unknown costs
        # favour the longest draft; measurements bring K down when the draft is poor.
        self.initial = max_k if initial is None else min(initial, max_k)
        self.reached = np.zeros(max_k + 1)
        self.accepted = np.zeros(max_k + 1)
        self.verify: deque[tuple[int, float]] = deque()
        self._sums = np.zeros(5)  # n, sum x, sum y, sum xx, sum xy over self.verify
        self.draft_per_token = 0.0
        self.other = 0.0
        self.rounds = 0

    def observe(
        self, k: int, accepted: int, card_wait_s: float, verify_s: float, other_s: float
    ) -> None:
        self.rounds += 1
        for j in range(1, k + 1):  # position j was reached if all before it were accepted
            if j - 1 <= accepted:
                self.reached[j] += 1
                self.accepted[j] += j <= accepted
        self._add(k + 1, verify_s, 1.0)
        self.verify.append((k + 1, verify_s))
        if len(self.verify) > self.HISTORY:
            self._add(*self.verify.popleft(), -1.0)
        alpha = 0.2
        if k:
            self.draft_per_token += alpha * (card_wait_s / k - self.draft_per_token)
        self.other += alpha * (other_s - self.other)

    def _add(self, x: float, y: float, sign: float) -> None:
        self._sums += sign * np.array([1.0, x, y, x * x, x * y])

    def _verify_time(self, n: np.ndarray) -> np.ndarray:
        """Least-squares line through the recent (tokens verified, seconds) pairs."""
        count, sx, sy, sxx, sxy = self._sums
        if count < 2:
            return n * 1.0
        spread = count * sxx - sx * sx
        if spread <= 1e-12:  # every round verified the same number of tokens
            return np.full(len(n), sy / count)
        slope = max((count * sxy - sx * sy) / spread, 0.0)
        intercept = (sy - slope * sx) / count
        return np.maximum(intercept + slope * n, 1e-9)

    def choose(self, max_k: int) -> int:
        max_k = min(max_k, self.max_k)
        if max_k <= 0:
            return 0
        if self.rounds < 2:
            return min(self.initial, max_k)
        a = (self.accepted[1:] + PRIOR * PRIOR_WEIGHT) / (self.reached[1:] + PRIOR_WEIGHT)
        expected = 1 + np.concatenate([[0.0], np.cumsum(np.cumprod(a))])  # index = K
        ks = np.arange(0, self.max_k + 1)
        time = self.other + self.draft_per_token * ks + self._verify_time(ks + 1)
        rate = expected / time
        best = int(np.argmax(rate[1 : max_k + 1])) + 1
        phase = self.rounds % self.EXPLORE_EVERY
        if phase == 0:
            best = min(best + 1, max_k)
        elif phase == self.EXPLORE_EVERY // 2:
            best = max(best - 1, 1)
        return best
