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

Sampling keeps the target's distribution exactly with a tree whose children are *drawn*:
``sampled_tree`` draws each node's children from the draft's distribution without replacement
(each from what is left, renormalised), and ``verify_tree_sampled`` is recursive rejection
sampling (Jeon et al. 2024): at a node, its children are tried in the order they were drawn,
each accepted with probability min(1, p(x) / q(x)); after a rejection p becomes the normalised
residual max(0, p - q) and q loses x (renormalised); when every child is rejected the token is
drawn from what p has become. Each try is one step of speculative sampling with the proposal
the child was drawn from, which is exact whatever that proposal is, so the kept path and the
token after it are distributed as the target's own sampling would make them.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from exstill_sdk.errors import ProtocolError, TargetOutputError
from exstill_sdk.protocol.drafts import Distribution, chain_links
from exstill_sdk.speculative.sampling import sample
from exstill_sdk.support.trees import ancestry, depths, grow_sampled_tree

__all__ = [
    "ROOT",
    "TokenTree",
    "ancestry",
    "best_first_tree",
    "depths",
    "greedy_path",
    "sampled_tree",
    "verify_tree_greedy",
    "verify_tree_sampled",
]

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
        return cls(tuple(tokens), chain_links(len(tokens)))

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


def main_chain_verdict(parents: Sequence[int], kept: Sequence[int]) -> tuple[int, int]:
    """(its length, how many of its tokens were kept) for the chain inside a tree (its
    ``parents``, as ``TokenTree`` holds them; ``kept``, the nodes verification kept): from the
    context, each node's first child (the draft's likeliest, as the card ranks and numbers
    them), as deep as the tree goes. A chain of that length drafted instead would have kept as
    many tokens (greedy: the target's tokens decide the same way; sampled: the first child is
    tried exactly as a chain's token is), so a tree round tells the chain's K policy what the
    text is doing."""
    first: dict[int, int] = {}
    for node, parent in enumerate(parents):
        first.setdefault(parent, node)
    length, node = 0, ROOT
    while node in first:
        length, node = length + 1, first[node]
    accepted, node = 0, ROOT
    for child in kept:
        if first.get(node) != child:
            break
        accepted, node = accepted + 1, child
    return length, accepted


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


def verify_tree_greedy(tree: TokenTree, target_logits: np.ndarray) -> tuple[list[int], int]:
    """(the kept nodes, the target's token after them): greedy verification of a tree scored in
    one pass (``target_logits`` as ``TargetAdapter.verify_tree`` returns them: row 0 after the
    context, row i + 1 after node i). Raises TargetOutputError when a logit it decides by is
    NaN or infinite, as ``acceptance.verify_greedy`` does for a chain."""
    best = target_logits.argmax(axis=-1)
    children = tree.children()
    kept: list[int] = []
    node = ROOT
    while True:
        if not math.isfinite(target_logits[node + 1, best[node + 1]]):
            raise TargetOutputError("target returned NaN or infinite logits")
        child = children[node].get(int(best[node + 1]))
        if child is None:
            return kept, int(best[node + 1])
        kept.append(child)
        node = child


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


def sampled_tree(
    next_probs: Callable[[list[int]], np.ndarray],
    budget: int,
    top_k: int,
    rng: np.random.Generator,
) -> TokenTree:
    """A tree for sampled verification (``verify_tree_sampled``): each node's children drawn
    one after another from the draft's distribution ``next_probs(path)`` without replacement
    (at most ``top_k``), listed in the order drawn, ``budget`` nodes in all; the slots are
    chosen as the card chooses them (exstill_sdk.support.trees.grow_sampled_tree)."""
    if budget < 1 or top_k < 1:
        raise ValueError("a tree needs a budget and top_k of at least 1")

    def path(node: int, tokens: list[int], parents: list[int]) -> list[int]:
        out: list[int] = []
        while node != ROOT:
            out.append(tokens[node])
            node = parents[node]
        return out[::-1]

    def open_nodes(
        nodes: list[int], tokens: list[int], parents: list[int]
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        out = []
        for node in nodes:
            q = np.asarray(next_probs(path(node, tokens, parents)), np.float64)
            out.append((np.arange(len(q)), q))
        return out

    def draw(_node: int, weights: np.ndarray) -> int:
        return sample(weights / weights.sum(), rng)

    grown = grow_sampled_tree(open_nodes, budget, top_k, budget, draw)
    return TokenTree(tuple(grown.tokens), tuple(grown.parents))


class DrawnRows(Mapping[int, np.ndarray]):
    """The draft's rows of ``q`` for ``verify_tree_sampled``, made when read: the walk reads
    only the rows of the nodes it passes through, and a dense row is a vocabulary's floats
    (a tree of 64 nodes over 49,152 tokens would build up to 64 of them a round)."""

    def __init__(self, first: dict[int, Distribution], vocab: int) -> None:
        self._first = first
        self._vocab = vocab
        self._rows: dict[int, np.ndarray] = {}

    def __getitem__(self, row: int) -> np.ndarray:
        if row not in self._rows:
            dist = self._first[row]
            dense = np.zeros(self._vocab)
            tokens = np.asarray(dist.tokens, np.int64)
            np.add.at(dense, tokens, np.asarray(dist.weights, np.float64))
            self._rows[row] = dense / dense.sum()
        return self._rows[row]

    def __iter__(self) -> Iterator[int]:
        return iter(self._first)

    def __len__(self) -> int:
        return len(self._first)


def drawn_from(tree: TokenTree, dists: Sequence[Distribution] | None, vocab: int) -> DrawnRows:
    """The draft's rows of ``q`` for ``verify_tree_sampled`` from a sampled tree's
    distributions on the wire (per node, the one it was drawn from): row p + 1 for each
    parent p, over ``vocab`` tokens, each made when the walk first reads it."""
    if dists is None or len(dists) != len(tree):
        raise ProtocolError(
            "the card's sampled tree lacks the distribution each node was drawn from"
        )
    first: dict[int, Distribution] = {}
    for parent, dist in zip(tree.parents, dists, strict=True):
        first.setdefault(parent + 1, dist)
    return DrawnRows(first, vocab)


def verify_tree_sampled(
    tree: TokenTree,
    p: np.ndarray,
    q: np.ndarray | Mapping[int, np.ndarray],
    rng: np.random.Generator,
) -> tuple[list[int], int]:
    """(the kept nodes, the token after them) by recursive rejection sampling (module
    docstring). ``p`` is [len(tree) + 1, vocab] probabilities of the target and ``q`` the
    draft's rows (an array like ``p``, or the rows of the nodes with children): row 0 after
    the context, row i + 1 after node i; a node's children must be listed in the order they
    were drawn from its row of ``q``."""
    kids: dict[int, list[int]] = {}
    for i, parent in enumerate(tree.parents):
        kids.setdefault(parent, []).append(i)
    kept: list[int] = []
    node = ROOT
    while True:
        target = p[node + 1].astype(np.float64)
        chosen = None
        draft = q[node + 1].astype(np.float64) if node in kids else target
        for child in kids.get(node, []):
            x = tree.tokens[child]
            if draft[x] <= 0:
                raise ProtocolError(
                    f"node {child}'s token {x} has probability 0 where it was drawn"
                )
            if rng.random() * draft[x] < target[x]:  # u < p/q without dividing
                chosen = child
                break
            residual = np.maximum(target - draft, 0.0)
            target = residual / residual.sum() if residual.sum() > 0 else target
            draft = draft.copy()
            draft[x] = 0.0
            if draft.sum() <= 0:
                break
            draft /= draft.sum()
        if chosen is None:
            return kept, sample(target, rng)
        kept.append(chosen)
        node = chosen
