"""Drafting ahead for several verification outcomes: which outcomes, and how many fit.

After the card replies with a draft d1..dk (and its guess g for the target's token after it),
the host's verification ends in one outcome: the first j drafted tokens accepted and the
target's token b after them. The prefetcher drafts the next round ahead for (k, g) first
(prefetch.py); in the time the target still takes it drafts ahead for the next likeliest
outcomes too, all of them together in a token tree (``EngineState.draft_outcomes``), so that a
COMMIT of any of them is answered at once.

An outcome's likelihood comes from the draft's own distributions, calibrated by its image's
rank temperature (``ranking_probs``): P(first j accepted) = the product of the drafted tokens'
probabilities, times b's probability at position j+1 (for j < k, b is not the drafted token,
which the target refused). How many outcomes fit is measured, not configured: the card times
its passes (``PassCost``: a fixed part and a part per outcome) and learns, per stream, how long
the host takes from the card's reply to its next COMMIT; the outcomes are then the likeliest
ones, over every stream waiting, whose passes fit in that time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from .engines.base import OutcomeDraft
from .engines.sampling import ranking_probs

CANDIDATES = 4
"""Alternatives to the drafted token considered at each position."""
MAX_WIDTH = 16
"""Most outcomes drafted ahead for one stream in one round: on the demo pair at K = 8, the 8
likeliest with full acceptance cover 81% of rounds, 16 cover 90% and 32 no more than 24 (92%),
for twice the card's work (docs/benchmarks.md, prefetch)."""
MAX_LOGIT_BYTES = 64 << 20
"""Most memory the kept logits of one stream's outcome drafts may take."""
WINDOW_SHARE = 0.85
"""The share of the host's verification time the card plans to fill."""


class Outcome(NamedTuple):
    score: float
    """Its probability under the calibrated draft."""
    accepted: int
    bonus: int


def rank_outcomes(
    tokens: Sequence[int], logits: np.ndarray, limit: int, temperature: float
) -> list[Outcome]:
    """The ``limit`` likeliest outcomes of a draft other than the one the prefetcher drafts
    for first. ``tokens``: the draft and its guess (k + 1); ``logits``: the k + 1 rows they
    were chosen from; ``temperature``: the draft's rank temperature."""
    k = len(tokens) - 1
    if k < 0 or limit <= 0 or len(logits) < k + 1:
        return []
    probs = ranking_probs(logits[: k + 1], temperature)
    drafted = np.asarray(tokens, np.int64)
    reach = np.concatenate([[1.0], np.cumprod(probs[np.arange(k), drafted[:k]])])
    width = min(CANDIDATES + 1, probs.shape[1])
    top = np.argpartition(-probs, width - 1, axis=-1)[:, :width]
    scores = reach[:, None] * np.take_along_axis(probs, top, axis=-1)
    scores[top == drafted[:, None]] = 0.0
    best = np.argsort(-scores, axis=None, kind="stable")[:limit]
    out = []
    for flat in best:
        j, c = divmod(int(flat), width)
        if scores[j, c] <= 0:
            break
        out.append(Outcome(float(scores[j, c]), j, int(top[j, c])))
    return out


def width_limit(count: int, vocab: int, keep_logits: bool) -> int:
    """Most outcomes one stream may draft ahead for, ``count`` tokens each."""
    if not keep_logits or not vocab:
        return MAX_WIDTH
    return max(1, min(MAX_WIDTH, MAX_LOGIT_BYTES // (4 * count * vocab)))


class PassCost:
    """Seconds one pass of the outcome tree takes for a number of outcomes, fitted to the
    passes timed so far (least squares on the latest ``HISTORY``): a + b·width. Before any
    pass was timed, a guess from the chain steps timed (``chain_step``): a pass of the tree
    graph costs about two chain steps, and a quarter of a step more per outcome (measured on
    the demo draft: docs/emulator.md)."""

    HISTORY = 64

    def __init__(self) -> None:
        self._seen: deque[tuple[int, float]] = deque(maxlen=self.HISTORY)
        self._step = 0.0

    def add(self, width: int, seconds: float) -> None:
        self._seen.append((width, seconds))

    def chain_step(self, seconds: float) -> None:
        """What one chain step took (the full-acceptance draft's)."""
        self._step = seconds if not self._step else self._step + 0.25 * (seconds - self._step)

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None before anything was timed. With one width seen, half the time is
        taken as fixed."""
        if not self._seen:
            return (2 * self._step, self._step / 4) if self._step else None
        widths = np.array([w for w, _ in self._seen], np.float64)
        times = np.array([t for _, t in self._seen], np.float64)
        if np.ptp(widths) == 0:
            per = float(np.median(times))
            return per / 2, per / 2 / widths[0]
        b, a = np.polyfit(widths, times, 1)
        return max(float(a), 0.0), max(float(b), 1e-7)


class Planned(NamedTuple):
    job: int
    """The job's index in the list planned for."""
    roots: list[tuple[int, int]]


def plan_outcomes(
    jobs: Sequence[tuple[list[Outcome], int, int]],
    seconds: float,
    fit: tuple[float, float] | None,
) -> list[Planned]:
    """Which outcomes to draft ahead for: ``jobs`` (ranked outcomes, tokens to draft after
    each, most outcomes) per stream; the likeliest outcomes over every stream whose passes
    fit in ``seconds``, a stream's first outcome paying its passes' fixed part (``fit``: a
    pass's cost, ``PassCost.fit``); none before anything was timed."""
    if fit is None:
        return []
    a, b = fit
    everything = sorted(
        ((o.score, i, o) for i, (ranked, _, _) in enumerate(jobs) for o in ranked),
        key=lambda item: -item[0],
    )
    chosen: dict[int, list[tuple[int, int]]] = {}
    left = seconds
    for _, i, o in everything:
        _, count, limit = jobs[i]
        roots = chosen.get(i, [])
        if len(roots) >= limit:
            continue
        price = count * (b + (0 if roots else a))
        if price > left:
            continue
        left -= price
        chosen.setdefault(i, []).append((o.accepted, o.bonus))
    return [Planned(i, roots) for i, roots in chosen.items()]


class OutcomeSet(NamedTuple):
    """A stream's drafts made (or begun) ahead for other outcomes, by what their COMMIT
    commits."""

    version: int
    drafts: dict[bytes, OutcomeDraft]
    complete: bool
    """Every draft has all its tokens (the work was not stopped)."""
