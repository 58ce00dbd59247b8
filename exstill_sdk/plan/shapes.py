"""The draft shapes the planner weighs, a chain of K tokens or a tree of N nodes, each as what
a round with it can end in.

A round ends in one outcome: some drafted tokens accepted (a path of the tree from its root),
then the target's own token after them (the bonus). Its chance follows from the acceptance
profile: a node's value is the product, along its path, of the chance that the target's token
is the draft's choice of that rank there (``Acceptance.ranks``); an outcome is a node and a
bonus that is not one of its children: the node's value times that bonus's chance, or, for a
bonus none of the draft's choices names, what is left. The card can draft the next round ahead
for an outcome whose bonus it can name (one of its choices), not for the rest.

A tree holds the N nodes of highest value, taken best first as the SDK's ``best_first_tree``
takes them from the draft's own probabilities (here from the acceptance profile's, and without
the hot path's imports), so the nodes at one depth are alternatives of which at most one is
accepted: a tree keeps, on average, one token more than the root plus the sum of its values.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from dataclasses import dataclass
from functools import cache
from itertools import count
from typing import Protocol

import numpy as np

UNNAMED = 1 << 30
"""``DraftShape.bonus_rank`` of a bonus none of the draft's choices names."""


class Acceptance(Hashable, Protocol):
    """What a shape needs of an acceptance profile (``acceptance.Acceptance``)."""

    @property
    def source(self) -> str: ...

    @property
    def rank_share(self) -> tuple[float, ...]: ...

    def ranks(self, position: int) -> list[float]: ...


@dataclass(frozen=True)
class DraftShape:
    kind: str
    """``chain`` or ``tree``."""
    size: int
    """Drafted tokens: K, or the tree's nodes."""
    levels: tuple[int, ...]
    """Nodes at depth 1, 2, ...: a chain's are all 1."""
    chance: np.ndarray
    """Each outcome's chance: the full-acceptance one first (every drafted token of the
    draft's first choices accepted, and the first choice after them), then the others whose
    bonus is one of the draft's choices, likeliest first, then those whose bonus none names
    (``named``: those a card can draft ahead for)."""
    accepted: np.ndarray
    """Drafted tokens each outcome accepts."""
    bonus_rank: np.ndarray
    """Each outcome's bonus among the draft's choices after its last accepted token: 0 its
    first, 1 its second, ...; ``UNNAMED`` for a bonus none of them names."""

    def __str__(self) -> str:
        return f"{self.kind} of {self.size}" if self.size else "no draft"

    @property
    def mean_length(self) -> float:
        """Tokens a round emits: the accepted and the bonus."""
        return 1.0 + float(self.chance @ self.accepted)

    @property
    def steps(self) -> tuple[int, ...]:
        """Rows of each step of the draft that makes this shape: the bonus taken in, then one
        step over each depth's nodes (the last giving what follows them)."""
        return (1, *self.levels)

    def named(self, candidates: int) -> np.ndarray:
        """The outcomes a card that weighs ``candidates`` alternatives to each drafted token
        (its first ``candidates + 1`` choices) can draft ahead for, likeliest first."""
        return np.flatnonzero(self.bonus_rank <= candidates)

    def reach(self, depth: int) -> float:
        """The chance that at least ``depth`` drafted tokens are accepted."""
        return float(self.chance[self.accepted >= depth].sum())


def chain_shape(acceptance: Acceptance, k: int) -> DraftShape:
    """K tokens, each the draft's first choice."""
    return _shape(acceptance, "chain", tuple(0 for _ in range(k)), tuple(range(-1, k - 1)))


@cache
def tree_shape(acceptance: Acceptance, nodes: int, depth_cap: int | None = None) -> DraftShape:
    """The ``nodes`` nodes of highest value, each among its parent's draft choices, none
    deeper than ``depth_cap`` (a ``TreeRequest``'s depth) when given."""
    ranks: list[int] = []
    parents: list[int] = []
    depth: list[int] = []
    heap: list[tuple[float, int, int, int]] = []  # (-value, order, parent, rank)
    order = count()  # ties go to the earlier candidate

    def offer(parent: int, value: float, at: int) -> None:
        for rank, q in enumerate(acceptance.ranks(at + 1)):
            heapq.heappush(heap, (-value * q, next(order), parent, rank))

    offer(-1, 1.0, 0)
    while heap and len(ranks) < nodes:
        value, _, parent, rank = heapq.heappop(heap)
        ranks.append(rank)
        parents.append(parent)
        depth.append(depth[parent] + 1 if parent >= 0 else 1)
        if depth_cap is None or depth[-1] < depth_cap:
            offer(len(ranks) - 1, -value, depth[-1])
    return _shape(acceptance, "tree", tuple(ranks), tuple(parents))


def _shape(
    acceptance: Acceptance, kind: str, ranks: tuple[int, ...], parents: tuple[int, ...]
) -> DraftShape:
    """The shape whose node i is its parent's choice of rank ``ranks[i]`` (``parents[i]``,
    -1 the root), parents listed before their children."""
    value, depth = [1.0], [0]  # index 0: the root, node i is i + 1
    children: list[dict[int, int]] = [{}]  # by rank
    for rank, parent in zip(ranks, parents, strict=True):
        p = parent + 1
        value.append(value[p] * acceptance.ranks(depth[p] + 1)[rank])
        depth.append(depth[p] + 1)
        children.append({})
        children[p][rank] = len(value) - 1
    full = 0  # the node the first choices lead to
    while 0 in children[full]:
        full = children[full][0]
    first: tuple[float, int, int] = (0.0, 0, 0)
    others: list[tuple[float, int, int]] = []
    unnamed: list[tuple[float, int, int]] = []
    for node, (v, d) in enumerate(zip(value, depth, strict=True)):
        choices = acceptance.ranks(d + 1)
        for rank, q in enumerate(choices):
            if rank in children[node]:
                continue
            if node == full and rank == 0:
                first = (v * q, d, 0)
            else:
                others.append((v * q, d, rank))
        unnamed.append((v * max(0.0, 1.0 - sum(choices)), d, UNNAMED))
    others.sort(key=lambda o: -o[0])
    outcomes = [first, *others, *unnamed]
    levels = np.bincount(np.array(depth[1:], dtype=np.int64))[1:] if ranks else ()
    return DraftShape(
        kind=kind,
        size=len(ranks),
        levels=tuple(int(w) for w in levels),
        chance=np.array([c for c, _, _ in outcomes]),
        accepted=np.array([d for _, d, _ in outcomes]),
        bonus_rank=np.array([r for _, _, r in outcomes]),
    )


def named_shape(acceptance: Acceptance, name: str) -> DraftShape:
    """``chain of K`` or ``tree of N``, as ``str(DraftShape)`` writes them."""
    kind, _, size = name.partition(" of ")
    if kind not in ("chain", "tree") or not size.isdigit():
        raise ValueError(f"a shape is 'chain of K' or 'tree of N', not {name!r}")
    if kind == "tree" and not acceptance.rank_share:
        raise ValueError(
            f"{name}: a tree needs the acceptance of the draft's other choices (top_k or "
            f"tree_mean_length in the acceptance profile; {acceptance.source} has neither)"
        )
    return (chain_shape if kind == "chain" else tree_shape)(acceptance, int(size))
