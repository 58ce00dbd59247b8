"""Token trees as the host's targets and the card's engines both need them: a tree's shape from
its parent list (node i's parent < i; -1: the context), to lay it out for attention, and the
growth of a tree whose children are drawn, for exact sampled verification."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np


def ancestry(parents: Sequence[int]) -> np.ndarray:
    """[N, N] bool: node j is node i or one of its ancestors (parents[i] < i; -1: none)."""
    n = len(parents)
    seen = np.zeros((n, n), bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            seen[i] = seen[parent]
        seen[i, i] = True
    return seen


def depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth: 1 for a child of the context."""
    out: list[int] = []
    for parent in parents:
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


class SampledTree(NamedTuple):
    """A tree whose children were drawn (``grow_sampled_tree``): nodes numbered in the order
    drawn, so a parent comes before its children and siblings come in their draw order."""

    tokens: list[int]
    parents: list[int]
    """Node i's parent (< i; -1: the context)."""
    drawn_from: dict[int, tuple[np.ndarray, np.ndarray]]
    """Per node with children (-1: the context), the (token ids, weights) its children were
    drawn from, one after another without replacement: q(ids[i]) = weights[i] / sum."""


OpenNodes = Callable[[list[int], "list[int]", "list[int]"], list[tuple[np.ndarray, np.ndarray]]]
"""(nodes to open, every node's token, every node's parent) -> each node's (ids, weights)."""
Draw = Callable[[int, np.ndarray], int]
"""(the node whose child is drawn, its weights not drawn yet) -> the index drawn, with
probability proportional to its weight."""


def grow_sampled_tree(
    open_nodes: OpenNodes, budget: int, top_k: int, levels: int, draw: Draw
) -> SampledTree:
    """A tree for exact sampled verification (recursive rejection sampling over siblings), up to
    ``budget`` nodes, ``top_k`` children a node, ``levels`` deep.

    Which child slots the budget goes to is decided best first, and a slot is ranked *before*
    its token is drawn: by its parent's value (the product of the draft's probabilities along
    its path), the mass its parent has left to draw from, and the chance a draw from that lands
    on a likely token (the sum of the renormalised probabilities squared); never above its
    previous sibling. A slot is taken before anything under it or after it among its siblings
    is grown, so whether a node exists never depends on its own token or on what is drawn under
    it: the law recursive rejection sampling assumes holds.

    The draft's distributions are asked for lazily and in batches: a node drawn waits in the
    queue at its value (a bound on its first slot's rank) and is opened when it comes first,
    together with every other node waiting then, so an engine runs one pass for a batch. The
    tree is the one eager best-first growth would give."""
    if budget < 1 or top_k < 1 or levels < 1:
        raise ValueError("a tree needs a budget, top_k and depth of at least 1")
    tokens: list[int] = []
    parents: list[int] = []
    depth: dict[int, int] = {-1: 0}
    value: dict[int, float] = {-1: 1.0}
    drawn_from: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    opened: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    left: dict[int, np.ndarray] = {}  # per open node: its weights not drawn yet
    total: dict[int, float] = {}
    children: dict[int, int] = {}
    heap: list[tuple[float, int, int, bool]] = []  # (-rank, order, node, is it a child slot)
    waiting: list[int] = []  # nodes queued to be opened, not opened yet
    order = 0

    def push(rank: float, node: int, slot: bool) -> None:
        nonlocal order
        heapq.heappush(heap, (-rank, order, node, slot))
        order += 1

    def offer_slot(node: int, bound: float) -> None:
        weights = left[node]
        mass = float(weights.sum())
        if mass <= 0 or children.get(node, 0) >= top_k:
            return
        share = weights / mass
        push(min(bound, value[node] * mass / total[node] * float(share @ share)), node, True)

    push(1.0, -1, False)
    waiting.append(-1)
    while heap and len(tokens) < budget:
        negative, _, node, slot = heapq.heappop(heap)
        if not slot:  # open the node: rank its first child slot
            if node not in opened:
                batch = [n for n in waiting if n not in opened]
                for n, dist in zip(batch, open_nodes(batch, tokens, parents), strict=True):
                    opened[n] = dist
                waiting.clear()
            ids, weights = opened[node]
            left[node] = np.asarray(weights, np.float64).copy()
            total[node] = float(left[node].sum())
            drawn_from[node] = (ids, weights)
            offer_slot(node, 1.0)
            continue
        weights = left[node]
        index = draw(node, weights)
        child = len(tokens)
        tokens.append(int(drawn_from[node][0][index]))
        parents.append(node)
        value[child] = value[node] * float(weights[index]) / total[node]
        depth[child] = depth[node] + 1
        weights[index] = 0.0
        children[node] = children.get(node, 0) + 1
        offer_slot(node, -negative)
        if len(tokens) < budget and depth[child] < levels:
            push(value[child], child, False)
            waiting.append(child)
    return SampledTree(tokens, parents, {n: d for n, d in drawn_from.items() if n in children})
