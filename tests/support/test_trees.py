"""The growth of a sampled tree (support/trees.py), shared by the card and the host: asked for
the draft's distributions in batches, it makes the tree that growing it eagerly, one node's
distribution at a time, makes."""

from __future__ import annotations

import heapq
import zlib

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from exstill_sdk.support.trees import grow_sampled_tree

VOCAB = 12


def probs(path: tuple[int, ...], seed: int) -> np.ndarray:
    """A draft distribution that depends on the whole path."""
    key = zlib.crc32(bytes(path) + seed.to_bytes(4, "little"))
    return np.random.default_rng(key).dirichlet(np.full(VOCAB, 0.4))


def draws(seed: int):
    """Each node's children from a generator of its own, as on the card."""
    generators: dict[int, np.random.Generator] = {}

    def draw(node: int, weights: np.ndarray) -> int:
        rng = generators.setdefault(node, np.random.default_rng([seed, node + 1]))
        return int(rng.choice(len(weights), p=weights / weights.sum()))

    return draw


def eager(seed: int, budget: int, top_k: int) -> tuple[list[int], list[int]]:
    """Best-first growth that opens every node as soon as it is drawn (the rule written out
    plainly): (tokens, parents)."""
    draw = draws(seed)
    tokens: list[int] = []
    parents: list[int] = []
    paths: dict[int, tuple[int, ...]] = {-1: ()}
    value = {-1: 1.0}
    left: dict[int, np.ndarray] = {}
    count: dict[int, int] = {}
    heap: list[tuple[float, int, int]] = []
    order = 0

    def offer(node: int, bound: float) -> None:
        nonlocal order
        q = left[node]
        mass = float(q.sum())
        if mass > 0 and count.get(node, 0) < top_k:
            rank = min(bound, value[node] * mass * float(np.square(q / mass).sum()))
            heapq.heappush(heap, (-rank, order, node))
            order += 1

    def open_node(node: int) -> None:
        left[node] = probs(paths[node], seed)
        offer(node, 1.0)

    open_node(-1)
    while heap and len(tokens) < budget:
        negative, _, parent = heapq.heappop(heap)
        q = left[parent]
        index = draw(parent, q)
        node = len(tokens)
        tokens.append(index)
        parents.append(parent)
        paths[node] = (*paths[parent], index)
        value[node] = value[parent] * float(q[index])
        q[index] = 0.0
        count[parent] = count.get(parent, 0) + 1
        offer(parent, -negative)
        if len(tokens) < budget:
            open_node(node)
    return tokens, parents


def grow(seed: int, budget: int, top_k: int, batches: list[int]):
    """``grow_sampled_tree`` over ``probs``, noting how many nodes each ask was for."""

    def open_nodes(nodes, tokens, parents):
        batches.append(len(nodes))

        def path(n: int) -> tuple[int, ...]:
            return () if n < 0 else (*path(parents[n]), tokens[n])

        return [(np.arange(VOCAB), probs(path(n), seed)) for n in nodes]

    return grow_sampled_tree(open_nodes, budget, top_k, budget, draws(seed))


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 24), st.integers(1, 4))
def test_batched_growth_makes_the_eager_tree(seed: int, budget: int, top_k: int) -> None:
    grown = grow(seed, budget, top_k, [])
    assert (grown.tokens, grown.parents) == eager(seed, budget, top_k)
    assert len(grown.tokens) == budget  # every slot could be drawn: the budget is spent
    for parent, (ids, weights) in grown.drawn_from.items():
        assert parent in grown.parents and np.allclose(weights, probs(path_of(grown, parent), seed))
        assert ids.tolist() == list(range(VOCAB))


def path_of(grown, node: int) -> tuple[int, ...]:
    return () if node < 0 else (*path_of(grown, grown.parents[node]), grown.tokens[node])


def test_the_growth_asks_for_several_nodes_a_pass() -> None:
    batches: list[int] = []
    grown = grow(7, 16, 3, batches)
    assert (grown.tokens, grown.parents) == eager(7, 16, 3)
    assert max(batches) > 1 and len(batches) < len(grown.tokens)  # fewer asks than nodes


def test_a_depth_limit_leaves_the_deepest_nodes_unopened() -> None:
    opened: list[int] = []

    def open_nodes(nodes, tokens, parents):
        opened.extend(nodes)
        return [(np.arange(VOCAB), probs((n + 1,), 1)) for n in nodes]

    grown = grow_sampled_tree(open_nodes, 30, 2, 2, draws(3))
    depth = {-1: 0}
    for i, p in enumerate(grown.parents):
        depth[i] = depth[p] + 1
    assert max(depth.values()) == 2 and len(grown.tokens) == 6  # 2 + 2 x 2
    assert all(depth[n] < 2 for n in opened)
