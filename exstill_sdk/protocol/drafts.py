"""The round's two values, typed at every boundary: a ``Draft`` (what the card proposes) and a
``Verdict`` (what the target kept of it, and its own next token).

A draft is a chain (its tokens in order; a verdict keeps a prefix of them) or a token tree (its
tokens with each one's parent; a verdict keeps one path from the context, ``Verdict.path``).
What a verdict keeps is asked of the draft (``Draft.kept``, and ``kept_wire`` for the bytes the
card holds), so that the layers between see one type whatever the shape. Both are NamedTuples:
one of each is made every round.
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
    path: tuple[int, ...] = ()
    """For a tree draft, the kept nodes from the context on (``accepted`` of them); empty for a
    chain, whose first ``accepted`` tokens are kept."""


class Draft(NamedTuple):
    """The card's proposal for the next tokens of a stream (a DRAFT or COMMIT reply)."""

    tokens: tuple[int, ...]
    prefetch_hit: bool = False
    """True when the card had drafted this ahead while the host verified."""
    dists: tuple[Distribution, ...] | None = None
    """In DIST wire mode, the exact distribution each token was sampled from (a sampled
    tree's: its parent's, which its siblings were drawn from too)."""
    lookup: bool = False
    """True when prompt lookup drafted it (a stream opened with ``lookup=True``), not the
    model."""
    parents: tuple[int, ...] | None = None
    """A token tree's parent indices (-1: the context; each before its child); None for a
    chain. A tree whose every node follows the one before is a chain and is given as one."""

    def kept(self, verdict: Verdict) -> list[int]:
        """The tokens a round with this verdict adds to the sequence: the accepted drafted
        tokens (a tree's: along ``verdict.path``), then the target's own."""
        if self.parents is None:
            return [*self.tokens[: verdict.accepted], verdict.token]
        return [*(self.tokens[i] for i in verdict.path), verdict.token]

    def check(self, verdict: Verdict) -> None:
        """Refuse a verdict that keeps more than the draft holds, or, for a tree, a path that
        is not one."""
        if not 0 <= verdict.accepted <= len(self.tokens):
            raise InvalidArgumentError(
                f"accepted {verdict.accepted} but the last draft had {len(self.tokens)} tokens"
            )
        if self.parents is None and not verdict.path:
            return
        parents = self.parents or chain_links(len(self.tokens))
        if len(verdict.path) != verdict.accepted or not path_ok(parents, verdict.path):
            raise InvalidArgumentError(
                f"path {list(verdict.path)} is not a path of the last draft from the context"
            )


def path_ok(parents: tuple[int, ...] | list[int], path: tuple[int, ...] | list[int]) -> bool:
    """Whether ``path`` is a path of the tree from the context: each node the next one's
    parent, the first a child of the context (-1)."""
    before = -1
    for node in path:
        if not 0 <= node < len(parents) or parents[node] != before:
            return False
        before = node
    return True


def chain_links(n: int) -> tuple[int, ...]:
    """The parents of a chain of ``n`` tokens as a tree: each node's parent the one before."""
    return tuple(range(-1, n - 1))


def chain_or_tree(parents: tuple[int, ...]) -> tuple[int, ...] | None:
    """``Draft.parents`` for a drafted tree: None when it is a chain."""
    return None if parents == chain_links(len(parents)) else parents


NO_DRAFT = Draft(())
"""A round without drafted tokens: the target alone."""


def kept_wire(draft: bytes, accepted: int, token: bytes) -> bytes:
    """``Draft.kept`` on the bytes the card holds (u32 LE token ids): the committed tokens of a
    COMMIT that accepted ``accepted`` of ``draft`` and added ``token`` (4 bytes)."""
    return draft[: accepted << 2] + token


def kept_tree_wire(draft: bytes, path: bytes, token: bytes) -> bytes:
    """``Draft.kept`` of a tree on the card's bytes: the tokens of ``draft`` (u32 LE) at the
    nodes of ``path`` (u8 node indices), then ``token`` (4 bytes)."""
    return b"".join([draft[4 * i : 4 * i + 4] for i in path]) + token
