"""Token trees: a draft with branches, and the pure rules that build and verify one.

A tree holds drafted tokens as nodes, each with its parent (``-1``: the context itself), listed
so that a parent comes before its children; a chain of K tokens is the tree whose node i has
parent i - 1. One pass of the target scores every node (each position sees its own path), so a
tree of N drafted nodes costs the target what a chain of N does, and keeps the longest path the
target agrees with: where the draft hesitates between two tokens, a tree can hold both.

``best_first_tree`` builds the N nodes of highest cumulative draft probability (the product of
the draft's probabilities along the path), as EAGLE-2's reranking chooses them: every node's
value is at most its parent's, so taking candidates best first, each expanded to its ``top_k``
likeliest children, gives the best N. ``greedy_path`` is greedy verification: the target's own
choice at each step decides which child, if any, is kept.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from exstill_sdk.support.trees import ancestry, depths

__all__ = ["ROOT", "TokenTree", "ancestry", "best_first_tree", "depths", "greedy_path"]

ROOT = -1
"""The parent of the nodes that follow the context directly."""


@dataclass(frozen=True)
class TokenTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    """parents[i]: the node before node i, ``ROOT`` for the context; always < i."""

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError("a tree needs one parent per token")
        for i, p in enumerate(self.parents):
            if not ROOT <= p < i:
                raise ValueError(f"node {i}'s parent {p} does not come before it")

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> TokenTree:
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    def path(self, node: int) -> list[int]:
        """The tokens from the context to ``node``, ``node``'s own last."""
        out = []
        while node != ROOT:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]

    def children(self) -> dict[int, dict[int, int]]:
        """Per node (``ROOT`` included): its children, by token."""
        out: dict[int, dict[int, int]] = {ROOT: {}}
        for i, (token, parent) in enumerate(zip(self.tokens, self.parents, strict=True)):
            out.setdefault(i, {})
            out[parent].setdefault(token, i)  # a repeated sibling is never reached
        return out


def greedy_path(tree: TokenTree, target_tokens: Sequence[int]) -> list[int]:
    """The nodes greedy verification keeps: from the context, the child whose token is the
    target's next token (``target_tokens``: what the target picks after the context, then
    after each kept node), as long as there is one."""
    children = tree.children()
    kept: list[int] = []
    node = ROOT
    for token in target_tokens:
        node = children[node].get(token, ROOT)
        if node == ROOT:
            break
        kept.append(node)
    return kept


def best_first_tree(
    next_probs: Callable[[list[int]], np.ndarray], budget: int, top_k: int
) -> TokenTree:
    """The ``budget`` nodes of highest cumulative draft probability, each node one of its
    parent's ``top_k`` likeliest children. ``next_probs(path)`` is the draft's distribution
    after the context followed by ``path``; it is asked once per node taken (and for the
    context). Ties go to the earlier candidate, so the tree is deterministic."""
    if budget < 1 or top_k < 1:
        raise ValueError("a tree needs a budget and top_k of at least 1")
    tokens: list[int] = []
    parents: list[int] = []
    paths: list[list[int]] = []
    heap: list[tuple[float, int, int, int]] = []  # (-value, order, parent, token)
    order = 0

    def expand(node: int, value: float, path: list[int]) -> None:
        nonlocal order
        probs = next_probs(path)
        for token in np.argsort(-probs, kind="stable")[:top_k]:
            heapq.heappush(heap, (-value * float(probs[token]), order, node, int(token)))
            order += 1

    expand(ROOT, 1.0, [])
    while heap and len(tokens) < budget:
        value, _, parent, token = heapq.heappop(heap)
        path = [*(paths[parent] if parent != ROOT else []), token]
        tokens.append(token)
        parents.append(parent)
        paths.append(path)
        if len(tokens) < budget:
            expand(len(tokens) - 1, -value, path)
    return TokenTree(tuple(tokens), tuple(parents))
