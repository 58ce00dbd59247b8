"""The round's two values, typed at every boundary: a ``Draft`` (what the card proposes) and a
``Verdict`` (what the target kept of it, and its own next token).

A draft today is a chain: its tokens in order, a verdict keeps a prefix of them. What a verdict
keeps is asked of the draft (``Draft.kept``, and ``kept_wire`` for the bytes the card holds), so
that a draft of another shape (a token tree) is a new shape here, not a change in every layer.
Both are NamedTuples: one of each is made every round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from exstill_sdk.errors import InvalidArgumentError


@dataclass(frozen=True)
class Distribution:
    """One drafted position's distribution: q(tokens[i]) = weights[i] / sum(weights)."""

    tokens: tuple[int, ...]
    weights: tuple[int, ...]

    def probability(self, token: int) -> float:
        total = sum(self.weights)
        return sum(w for t, w in zip(self.tokens, self.weights, strict=True) if t == token) / total


class Verdict(NamedTuple):
    """The target's judgement of a draft: it kept the first ``accepted`` drafted tokens and
    wrote ``token`` after them (its correction at the first rejection, or the bonus token after
    a fully accepted draft)."""

    accepted: int
    token: int


class Draft(NamedTuple):
    """The card's proposal for the next tokens of a stream (a DRAFT or COMMIT reply)."""

    tokens: tuple[int, ...]
    prefetch_hit: bool = False
    """True when the card had drafted this ahead while the host verified."""
    dists: tuple[Distribution, ...] | None = None
    """In DIST wire mode, the exact distribution each token was sampled from."""
    lookup: bool = False
    """True when prompt lookup drafted it (a stream opened with ``lookup=True``), not the
    model."""

    def kept(self, verdict: Verdict) -> list[int]:
        """The tokens a round with this verdict adds to the sequence: the accepted drafted
        tokens, then the target's own."""
        return [*self.tokens[: verdict.accepted], verdict.token]

    def check(self, verdict: Verdict) -> None:
        """Refuse a verdict that keeps more than the draft holds."""
        if not 0 <= verdict.accepted <= len(self.tokens):
            raise InvalidArgumentError(
                f"accepted {verdict.accepted} but the last draft had {len(self.tokens)} tokens"
            )


NO_DRAFT = Draft(())
"""A round without drafted tokens: the target alone."""


def kept_wire(draft: bytes, accepted: int, token: bytes) -> bytes:
    """``Draft.kept`` on the bytes the card holds (u32 LE token ids): the committed tokens of a
    COMMIT that accepted ``accepted`` of ``draft`` and added ``token`` (4 bytes)."""
    return draft[: accepted << 2] + token
