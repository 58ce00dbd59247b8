"""The field's measure of a draft, from one greedy continuation of the target: how many tokens
each verification pass keeps, at every draft length K.

Greedy verification keeps a drafted token while it equals the target's own next token, then
adds the target's token where they part (or after the last drafted token): a pass keeps
``accepted + 1`` tokens. Two facts make the measure cheap:

- A draft model's chain drafted at position t agrees with the target as long as it is
  accepted, so its token at depth d is the draft's prediction given the target's own prefix
  ``y[:t+d]``: one teacher-forced pass of the draft over the continuation gives every chain's
  run of accepted tokens (``runs_from_matches``).
- A chain longer than K is cut at K, so the runs for the largest K give every smaller K.

``rounds`` then walks the continuation as a decoder would (a pass at t keeps ``a + 1`` tokens,
the next starts after them) and gives the mean tokens kept per pass, tau, with the per-depth
acceptance it saw. Everything here is numpy over small integer arrays; nothing runs a model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def runs_from_matches(matches: np.ndarray, max_k: int) -> np.ndarray:
    """For each position t, how many consecutive ``matches`` start at t, at most ``max_k``."""
    n = len(matches)
    runs = np.zeros(n + 1, dtype=np.int64)
    for t in range(n - 1, -1, -1):
        runs[t] = runs[t + 1] + 1 if matches[t] else 0
    return np.minimum(runs[:n], max_k)


def runs_from_chains(chains: list[list[int]], continuation: np.ndarray) -> np.ndarray:
    """For each position t, how many leading tokens of the chain drafted at t equal the
    continuation from t (drafters whose chains are not teacher-forced, such as prompt
    lookup)."""
    runs = np.zeros(len(continuation), dtype=np.int64)
    for t, chain in enumerate(chains):
        a = 0
        while a < len(chain) and t + a < len(continuation) and chain[a] == continuation[t + a]:
            a += 1
        runs[t] = a
    return runs


COVERAGE_KS = tuple(range(1, 9))
"""Widths k whose coverage is counted: the target's token among the draft's k likeliest."""


@dataclass(frozen=True)
class Rounds:
    passes: int
    """Verification passes to produce the continuation."""
    tokens: int
    """Tokens they kept (the continuation's length)."""
    reached: np.ndarray
    """reached[d-1]: passes whose draft was checked at depth d (1..K)."""
    accepted: np.ndarray
    """accepted[d-1]: passes that kept their drafted token at depth d."""
    covered: np.ndarray
    """covered[i, d-1]: passes that reached depth d with the target's token among the draft's
    ``COVERAGE_KS[i]`` most likely there (what a tree branching that wide could keep); zeros
    when no ranks were given."""

    @property
    def tau(self) -> float:
        """Mean tokens kept per verification pass (1.0 for the target alone)."""
        return self.tokens / self.passes if self.passes else 0.0

    @property
    def top_k(self) -> list[float]:
        """For k in ``COVERAGE_KS``: the share of the draft tokens checked, over every depth
        reached, whose target token was among the draft's k likeliest (what ``exstill plan``
        reads as ``acceptance.top_k``)."""
        checked = max(int(self.reached.sum()), 1)
        return [float(c) / checked for c in self.covered.sum(axis=1)]

    def __add__(self, other: Rounds) -> Rounds:
        """Both runs' passes and counts together (several prompts decoded with one K)."""
        return Rounds(
            self.passes + other.passes,
            self.tokens + other.tokens,
            self.reached + other.reached,
            self.accepted + other.accepted,
            self.covered + other.covered,
        )


def rounds(runs: np.ndarray, k: int, ranks: np.ndarray | None = None) -> Rounds:
    """Decode the continuation in passes drafting ``k`` tokens, given each position's run of
    accepted draft tokens: a pass at t accepts ``min(runs[t], k)`` (never past the last
    token, which the target's own token ends) and keeps one more. ``ranks`` (the target
    token's rank under a teacher-forced draft at each position, 0 = its argmax) adds the
    coverage at each depth reached."""
    n = len(runs)
    reached = np.zeros(k, dtype=np.int64)
    accepted = np.zeros(k, dtype=np.int64)
    covered = np.zeros((len(COVERAGE_KS), k), dtype=np.int64)
    widths = np.array(COVERAGE_KS)[:, None]
    t = passes = 0
    while t < n:
        a = int(min(runs[t], k, n - 1 - t))
        depth = min(a + 1, k, n - 1 - t)  # the depths whose draft token was checked
        reached[:depth] += 1
        accepted[:a] += 1
        if ranks is not None and depth:
            covered[:, :depth] += ranks[t : t + depth][None, :] < widths
        passes += 1
        t += a + 1
    return Rounds(passes, n, reached, accepted, covered)


def fastest_decode(runs: np.ndarray, costs: np.ndarray) -> float:
    """The least cost of decoding the continuation when each pass knew its run beforehand: a
    pass at t drafts any K' up to ``len(costs) - 1``, keeps min(``runs[t]``, K') + 1 tokens
    (never past the last one, as ``rounds`` counts) and costs ``costs[K']`` (``costs[0]``: a
    plain step). The bound on what choosing K per round can reach. Every K' is tried: a
    measured cost curve need not grow with K, and a fixed K's passes (each charged its K, as
    the pair's limit charges them) are among the schedules, so no fixed K does better."""
    n = len(runs)
    best = np.zeros(n + 1)
    for t in range(n - 1, -1, -1):
        run = min(int(runs[t]), n - 1 - t)
        best[t] = min(costs[k] + best[t + min(run, k) + 1] for k in range(len(costs)))
    return float(best[0])
