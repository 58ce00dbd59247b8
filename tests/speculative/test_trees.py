"""Token trees: the tree type, best-first building against brute force, greedy verification."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from exstill_sdk.errors import ProtocolError
from exstill_sdk.protocol.drafts import Distribution
from exstill_sdk.speculative.trees import (
    ROOT,
    TokenTree,
    best_first_tree,
    drawn_from,
    greedy_path,
    main_chain_verdict,
)

VOCAB = 5


def oracle(seed: int):
    """A draft over 5 tokens whose distribution depends on the whole path (a hash of it)."""

    def next_probs(path: list[int]) -> np.ndarray:
        rng = np.random.default_rng([seed, *path, len(path)])
        p = rng.random(VOCAB) ** 3
        return p / p.sum()

    return next_probs


def brute_force_values(next_probs, depth: int, top_k: int) -> dict[tuple[int, ...], float]:
    """Every path of at most ``depth`` tokens whose every step is among its parent's top_k,
    with its cumulative probability."""
    values: dict[tuple[int, ...], float] = {}
    frontier: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    for _ in range(depth):
        grown = []
        for path, value in frontier:
            probs = next_probs(list(path))
            for token in np.argsort(-probs, kind="stable")[:top_k]:
                child = (*path, int(token)), value * float(probs[token])
                values[child[0]] = child[1]
                grown.append(child)
        frontier = grown
    return values


@given(st.integers(0, 1000), st.integers(1, 6), st.integers(1, 3))
def test_best_first_takes_the_likeliest_paths(seed: int, budget: int, top_k: int) -> None:
    next_probs = oracle(seed)
    tree = best_first_tree(next_probs, budget, top_k)
    assert len(tree) == budget
    paths = [tuple(tree.path(i)) for i in range(len(tree))]
    assert len(set(paths)) == budget  # no node twice
    values = brute_force_values(next_probs, budget, top_k)
    chosen = sorted((values[p] for p in paths), reverse=True)
    best = sorted(values.values(), reverse=True)[:budget]
    assert chosen == pytest.approx(best)  # the best N values (ties may pick other paths)
    for i, parent in enumerate(tree.parents):  # closed under parents
        assert parent == ROOT or paths[parent] == paths[i][:-1]


def test_top_1_is_the_draft_chain() -> None:
    next_probs = oracle(7)
    tree = best_first_tree(next_probs, 6, 1)
    assert tree.parents == (-1, 0, 1, 2, 3, 4)
    chain: list[int] = []
    for _ in range(6):
        chain.append(int(np.argmax(next_probs(chain))))
    assert list(tree.tokens) == chain and tree == TokenTree.chain(chain)


@given(st.lists(st.integers(0, 3), max_size=8), st.lists(st.integers(0, 3), max_size=10))
def test_greedy_on_a_chain_keeps_the_common_prefix(draft: list[int], target: list[int]) -> None:
    kept = greedy_path(TokenTree.chain(draft), target)
    n = next(
        (i for i, (a, b) in enumerate(zip(draft, target, strict=False)) if a != b),
        min(len(draft), len(target)),
    )
    assert kept == list(range(n))


def test_greedy_follows_the_branch_the_target_takes() -> None:
    #        context
    #        /      \
    #      5(0)     7(1)
    #      /  \       \
    #   6(2)  8(3)    9(4)
    #          |
    #        10(5)
    tree = TokenTree((5, 7, 6, 8, 9, 10), (ROOT, ROOT, 0, 0, 1, 3))
    assert greedy_path(tree, [5, 8, 10, 11]) == [0, 3, 5]
    assert greedy_path(tree, [7, 9, 1]) == [1, 4]
    assert greedy_path(tree, [5, 6]) == [0, 2]
    assert greedy_path(tree, [4]) == []
    assert tree.path(5) == [5, 8, 10]


@given(
    st.integers(0, 1000),
    st.integers(1, 12),
    st.integers(1, 3),
    st.lists(st.integers(0, VOCAB - 1), max_size=12),
)
def test_a_tree_round_tells_what_its_chain_would_have_kept(
    seed: int, budget: int, top_k: int, target: list[int]
) -> None:
    """The chain inside a tree (each node's first child) is the draft's own chain, and the
    tokens greedy verification of the tree keeps along it are what the chain would have kept:
    what the decoder tells the chain's K policy after a tree round."""
    next_probs = oracle(seed)
    tree = best_first_tree(next_probs, budget, top_k)
    length, accepted = main_chain_verdict(tree.parents, greedy_path(tree, target))
    chain = best_first_tree(next_probs, length, 1)
    first = {}
    for node, parent in enumerate(tree.parents):
        first.setdefault(parent, node)
    node, inside = ROOT, []
    while node in first:
        node = first[node]
        inside.append(tree.tokens[node])
    assert inside == list(chain.tokens)
    assert accepted == len(greedy_path(chain, target))


def test_the_chain_inside_a_hand_built_tree() -> None:
    tree = TokenTree((5, 7, 6, 8, 9, 10), (ROOT, ROOT, 0, 0, 1, 3))  # as drawn above
    assert main_chain_verdict(tree.parents, [0, 2]) == (2, 2)  # 5, 6: the chain whole
    assert main_chain_verdict(tree.parents, [0, 3, 5]) == (2, 1)  # off the chain at 8
    assert main_chain_verdict(tree.parents, [1, 4]) == (2, 0)
    assert main_chain_verdict((), []) == (0, 0)


def test_the_drafts_rows_are_made_as_the_walk_reads_them() -> None:
    """Row p + 1 is the distribution node p's children were drawn from (the first one sent
    for p), normalised over the vocabulary, made when first read."""
    tree = TokenTree((5, 7, 6, 8, 9, 10), (ROOT, ROOT, 0, 0, 1, 3))
    after = {
        ROOT: Distribution((5, 7, 2), (6, 3, 1)),
        0: Distribution((6, 8), (1, 1)),
        1: Distribution((9,), (4,)),
        3: Distribution((10, 10, 1), (1, 2, 1)),  # a token twice: its weights add
    }
    dists = [after[p] for p in tree.parents]
    rows = drawn_from(tree, dists, 12)
    assert sorted(rows) == [0, 1, 2, 4] and len(rows) == 4
    assert not rows._rows  # nothing made before it is read
    assert rows[4][10] == pytest.approx(0.75) and rows[4][1] == pytest.approx(0.25)
    assert list(rows._rows) == [4]
    for parent, dist in after.items():
        want = np.array([dist.probability(t) for t in range(12)])
        assert rows[parent + 1] == pytest.approx(want)
    with pytest.raises(ProtocolError, match="distribution each node was drawn from"):
        drawn_from(tree, dists[:-1], 12)


def test_a_parent_after_its_child_is_refused() -> None:
    with pytest.raises(ValueError, match="does not come before"):
        TokenTree((1, 2), (1, ROOT))
    with pytest.raises(ValueError, match="one parent per token"):
        TokenTree((1, 2), (ROOT,))


def test_every_enumerated_path_is_reachable() -> None:
    """brute_force_values is the reference above: check it on a tiny case by hand."""
    values = brute_force_values(oracle(3), 2, 2)
    assert len(values) == 2 + 4
    assert all(len(p) in (1, 2) for p in values)
    assert set(itertools.chain.from_iterable(values)) <= set(range(VOCAB))


@functools.cache
def _distribution(seed: int, path: tuple[int, ...], sharp: float) -> np.ndarray:
    rng = np.random.default_rng([seed, *path, len(path)])
    x = rng.random(VOCAB) ** sharp
    return x / x.sum()


def _two_tokens_by_trees(
    rng: np.random.Generator, budget: int, top_k: int, rule=None
) -> tuple[int, int]:
    """The first two tokens of a sampled decode by trees: a target p and a draft q that
    differ, both depending on the whole path."""
    from exstill_sdk.speculative.trees import sampled_tree, verify_tree_sampled

    verify = rule or verify_tree_sampled
    out: list[int] = []
    while len(out) < 2:
        context = tuple(out)

        def draft(path: list[int], context: tuple[int, ...] = context) -> np.ndarray:
            return _distribution(2, (*context, *path), 2.0)

        tree = sampled_tree(draft, budget, top_k, rng)
        paths = [context, *((*context, *tree.path(i)) for i in range(len(tree)))]
        p = np.stack([_distribution(1, path, 1.0) for path in paths])
        q = np.stack([_distribution(2, path, 2.0) for path in paths])
        kept, token = verify(tree, p, q, rng)
        out += [tree.tokens[k] for k in kept] + [token]
    return out[0], out[1]


def _chi_square_p_value(budget: int, top_k: int, rule=None) -> float:
    from scipy.stats import chisquare

    rng = np.random.default_rng(12345)
    trials = 12000
    counts = np.zeros((VOCAB, VOCAB))
    for _ in range(trials):
        a, b = _two_tokens_by_trees(rng, budget, top_k, rule)
        counts[a, b] += 1
    first = _distribution(1, (), 1.0)
    expected = np.array(
        [[first[a] * _distribution(1, (a,), 1.0)[b] for b in range(VOCAB)] for a in range(VOCAB)]
    )
    return float(chisquare(counts.ravel(), expected.ravel() * trials).pvalue)


@pytest.mark.parametrize(("budget", "top_k"), [(1, 1), (4, 2), (6, 3)])
def test_sampled_trees_keep_the_targets_distribution(budget: int, top_k: int) -> None:
    """The joint law of the first two tokens is p(a) p(b | a), chi-square over 25 outcomes."""
    assert _chi_square_p_value(budget, top_k) > 1e-3


def test_the_chi_square_check_catches_a_wrong_rule() -> None:
    """Without the residual (the target's p kept after a rejection), the law is off."""
    from exstill_sdk.speculative.sampling import sample

    def no_residual(tree, p, q, rng):
        kids: dict[int, list[int]] = {}
        for i, parent in enumerate(tree.parents):
            kids.setdefault(parent, []).append(i)
        kept, node = [], ROOT
        while True:
            for child in kids.get(node, []):
                x = tree.tokens[child]
                if rng.random() * q[node + 1, x] < p[node + 1, x]:
                    kept.append(child)
                    node = child
                    break
            else:
                return kept, sample(p[node + 1], rng)

    assert _chi_square_p_value(4, 2, no_residual) < 1e-6


def test_a_tree_is_chosen_only_where_it_beats_every_chain() -> None:
    from exstill_sdk.speculative.shapes import Shape, choose_shape

    steps = {2: 1.1, 5: 1.3, 8: 1.5, 17: 2.2}.__getitem__  # plain steps to score n positions
    kept = {
        Shape("chain", 1): 1.7,
        Shape("chain", 4): 2.6,  # 2.00 tokens a step
        Shape("chain", 7): 2.9,  # 1.93
        Shape("tree", 7, 2): 3.2,  # 2.13
        Shape("tree", 16, 2): 4.0,  # 1.82
    }
    assert choose_shape(kept, steps) == (Shape("tree", 7, 2), pytest.approx(3.2 / 1.5))
    kept[Shape("tree", 7, 2)] = 2.9  # no better than the chain of 7: the chain of 4 wins
    assert choose_shape(kept, steps)[0] == Shape("chain", 4)
    # a tie: the chain, then the smaller draft
    assert choose_shape({Shape("chain", 4): 2.6, Shape("tree", 4, 2): 2.6}, steps)[0].kind == (
        "chain"
    )


def test_greedy_verification_of_a_scored_tree() -> None:
    from exstill_sdk.errors import TargetOutputError
    from exstill_sdk.speculative.trees import verify_tree_greedy

    tree = TokenTree((5, 7, 6, 8, 9, 10), (ROOT, ROOT, 0, 0, 1, 3))
    logits = np.zeros((len(tree) + 1, 12))
    for row, best in ((0, 5), (1, 8), (4, 10), (6, 11)):  # context -> 5 -> 8 -> 10, then 11
        logits[row, best] = 1.0
    assert verify_tree_greedy(tree, logits) == ([0, 3, 5], 11)
    logits[0] = 0.0
    logits[0, 4] = 1.0  # the target's first token is none of the root's children
    assert verify_tree_greedy(tree, logits) == ([], 4)
    logits[0, 3] = np.nan
    with pytest.raises(TargetOutputError, match="NaN"):
        verify_tree_greedy(tree, logits)
