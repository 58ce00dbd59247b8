"""Choosing drafted tokens from logits: greedy argmax, or sampling from a distribution the card
can send exactly.

Sampled drafting takes the ``max_entries`` most likely tokens (all, without a limit), shapes
them with the host's own shaping (exstill_sdk.support.sampling: temperature, top-k with ties
kept, top-p), quantises the probabilities to u16 integer weights, and only then samples, with
integer arithmetic, from those weights: the distribution on the wire (tokens and weights,
q(t) = w(t) / sum(w)) is exactly the one the token was drawn from.

Randomness is counter-based: the draw for the token at absolute position p of a stream comes
from Philox keyed by (seed, p). A seeded stream therefore drafts the same tokens however its
drafts were scheduled (inline or prefetched, batched or not).
"""

from __future__ import annotations

import numpy as np

from exstill_sdk.protocol.messages import Distribution
from exstill_sdk.support.sampling import shaped_probs

from .base import Sampling

WEIGHT_SCALE = 65535


def ranking_probs(logits: np.ndarray, temperature: float) -> np.ndarray:
    """Each row's softmax at ``temperature``: what the card drafts beyond one chain (a tree's
    branches, the outcomes it drafts ahead for) is ranked by the draft's probabilities
    calibrated by its image's ``rank_temperature`` (firmware/outcomes.py)."""
    z = (logits - logits.max(axis=-1, keepdims=True)) / temperature
    probs = np.exp(z)
    probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def greedy(logits: np.ndarray) -> int:
    return int(np.argmax(logits))


def distribution(logits: np.ndarray, s: Sampling) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, u16 weights) of the truncated, shaped and quantised distribution, most
    likely first."""
    ids = np.arange(len(logits))
    if s.max_entries and s.max_entries < len(logits):
        ids = np.sort(np.argpartition(-logits, s.max_entries - 1)[: s.max_entries])
    p = shaped_probs(logits[ids], s)
    order = np.argsort(-p, kind="stable")
    order = order[p[order] > 0]
    ids, p = ids[order], p[order]
    weights = np.rint(p * WEIGHT_SCALE).astype(np.int64)
    nonzero = weights > 0
    if not nonzero.any():  # cannot happen for the top token, kept for safety
        nonzero[0], weights[0] = True, 1
    return ids[nonzero], weights[nonzero].astype(np.uint16)


def draw(ids: np.ndarray, weights: np.ndarray, seed: int, position: int) -> int:
    """One token from integer weights, with the stream's counter-based generator."""
    rng = np.random.Generator(np.random.Philox(key=[seed & (2**64 - 1), position]))
    return int(ids[draw_index(weights, rng)])


def draw_index(weights: np.ndarray, rng: np.random.Generator) -> int:
    """The index of one entry of integer ``weights``, drawn in proportion to them."""
    cumulative = np.cumsum(weights, dtype=np.int64)
    r = int(rng.integers(0, int(cumulative[-1])))
    return int(np.searchsorted(cumulative, r, side="right"))


TREE_DRAWS = 1 << 63
"""Marks a tree's generators apart from the chain's (whose key is a position below 2**63)."""


def tree_draws(seed: int, base: int, node: int) -> np.random.Generator:
    """The generator a sampled tree draws node ``node``'s children from (-1: the context's),
    for the tree drafted after ``base`` committed tokens: a stream of its own for every node of
    every round (each round commits a token, so ``base`` grows), so that no draw depends on
    another; seeded as the chain's are, whatever the schedule."""
    key = TREE_DRAWS | (base << 8) | (node + 1)
    return np.random.Generator(np.random.Philox(key=[seed & (2**64 - 1), key]))


def choose(logits: np.ndarray, s: Sampling, position: int) -> tuple[int, Distribution | None]:
    """The drafted token for ``position`` and, when sampled, its distribution."""
    if s.greedy:
        return greedy(logits), None
    ids, weights = distribution(logits, s)
    token = draw(ids, weights, s.seed or 0, position)
    return token, Distribution(tuple(int(i) for i in ids), tuple(int(w) for w in weights))
