"""Verifying a draft: which drafted tokens the target accepts, and the token it adds.

Every rule returns a ``Verdict(accepted, token)``: the first ``accepted`` drafted tokens are
accepted and ``token`` follows them, the target's own (its correction at the first rejection,
or the bonus after a fully accepted draft). All three keep the output exactly the target's:

- greedy: accept while the draft equals the target's argmax; the token is the target's argmax
  at the first difference (or after the draft);
- sampled, with the card's distribution q for each drafted token (DIST wire mode): accept x
  with probability min(1, p(x) / q(x)); on rejection draw from the normalised residual
  max(0, p - q); after a fully accepted draft draw the bonus from p (Leviathan et al. 2023);
- sampled, tokens only (TOKENS wire mode, or a deterministic draft): treat q as one-hot on x,
  so accept with probability p(x), else draw from p with x removed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from exstill_sdk.errors import ProtocolError, TargetOutputError
from exstill_sdk.protocol.drafts import Distribution, Verdict
from exstill_sdk.speculative.sampling import sample


def verify_greedy(draft: Sequence[int], target_logits: np.ndarray) -> Verdict:
    """Raises TargetOutputError when a logit it decides by is NaN or infinite (NaN and +inf
    always win the argmax, so one pass over the logits finds both)."""
    best = target_logits.argmax(axis=-1)
    n = 0
    while n < len(draft) and draft[n] == best[n]:
        n += 1
    for i in range(n + 1):
        if not math.isfinite(target_logits[i, best[i]]):
            raise TargetOutputError("target returned NaN or infinite logits")
    return Verdict(n, int(best[n]))


def dense(dist: Distribution, vocab: int) -> np.ndarray:
    """A wire distribution as a probability vector over the vocabulary."""
    q = np.zeros(vocab, np.float64)
    tokens = np.asarray(dist.tokens, np.int64)
    if tokens.size and (tokens.max() >= vocab or tokens.min() < 0):
        raise ProtocolError(f"the card's distribution names token {tokens.max()} >= vocab {vocab}")
    np.add.at(q, tokens, np.asarray(dist.weights, np.float64))
    return q / q.sum()


def verify_with_distributions(
    draft: Sequence[int],
    dists: Sequence[Distribution],
    p: np.ndarray,
    rng: np.random.Generator,
) -> Verdict:
    vocab = p.shape[-1]
    for i, x in enumerate(draft):
        q = dense(dists[i], vocab)
        if q[x] <= 0:
            raise ProtocolError(f"drafted token {x} has probability 0 in its own distribution")
        if rng.random() * q[x] < p[i, x]:  # u < p/q without dividing
            continue
        residual = np.maximum(p[i] - q, 0.0)
        return Verdict(i, sample(residual, rng))
    return Verdict(len(draft), sample(p[len(draft)], rng))


def verify_tokens_only(draft: Sequence[int], p: np.ndarray, rng: np.random.Generator) -> Verdict:
    for i, x in enumerate(draft):
        if rng.random() < p[i, x]:
            continue
        rest = p[i].copy()
        rest[x] = 0.0
        return Verdict(i, sample(rest, rng))
    return Verdict(len(draft), sample(p[len(draft)], rng))
