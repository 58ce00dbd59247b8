"""A token tree scored in one run of the tree graph, against each of its paths scored as a
chain; the kept path's cache; and greedy decoding by trees, token for token the target's."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exstill_sdk.adapters.onnx import OnnxTarget
from exstill_sdk.demo import POSITIONS, demo_dir
from exstill_sdk.speculative.trees import (
    ROOT,
    TokenTree,
    best_first_tree,
    greedy_path,
    verify_tree_greedy,
)


@pytest.fixture(scope="module")
def target() -> OnnxTarget:
    return OnnxTarget(demo_dir() / "target.img", max_sequences=3, positions=POSITIONS, threads=1)


@pytest.fixture(scope="module")
def draft() -> OnnxTarget:
    return OnnxTarget(demo_dir() / "draft.img", positions=POSITIONS, threads=1)


@st.composite
def trees(draw: st.DrawFn) -> TokenTree:
    n = draw(st.integers(0, 12))
    parents = [draw(st.integers(ROOT, i - 1)) for i in range(n)]
    tokens = draw(st.lists(st.integers(0, 4095), min_size=n, max_size=n))
    return TokenTree(tuple(tokens), tuple(parents))


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(trees(), st.lists(st.integers(0, 4095), min_size=1, max_size=40), st.integers(0, 3))
def test_each_node_scores_as_its_path_would(
    target: OnnxTarget, tree: TokenTree, context: list[int], cached: int
) -> None:
    """Row 0 is the context's last position, row i + 1 node i's path; the same logits as a
    chain of that path (a part of the context may be cached already, as after a round)."""
    target.release(0)
    if cached and len(context) > cached:
        target.verify(0, context[:-cached], [])  # the target holds part of the context
    logits = target.verify_tree(0, context, tree)
    assert logits.shape == (len(tree) + 1, target.vocab_size)
    target.release(1)
    np.testing.assert_allclose(logits[0], target.verify(1, context, [])[-1], atol=2e-4)
    for i in range(len(tree)):
        target.release(1)
        chain = target.verify(1, context, tree.path(i))[-1]
        np.testing.assert_allclose(logits[i + 1], chain, atol=2e-4)


def test_the_kept_path_is_cached_as_a_chain(target: OnnxTarget) -> None:
    context = list(range(100, 140))
    tree = TokenTree((7, 8, 9, 10, 11), (ROOT, ROOT, 1, 2, 1))
    target.release(0)
    target.verify_tree(0, context, tree)
    target.keep_path(0, tree, [1, 2, 3])  # tokens 8, 9, 10
    after = target.verify(0, [*context, 8, 9, 10], [5, 6])  # only the draft is new now
    target.release(1)
    expected = target.verify(1, [*context, 8, 9, 10], [5, 6])
    np.testing.assert_allclose(after, expected, atol=2e-4)


def test_greedy_decoding_by_trees_is_the_targets_own(target: OnnxTarget, draft: OnnxTarget) -> None:
    """Host-side rounds: a best-first tree of the draft, scored in one pass, the path greedy
    verification keeps plus the target's next token; 64 tokens, exactly target.greedy's."""
    prompt = list(range(300, 340))
    reference = target.greedy(prompt, 64)
    out: list[int] = []
    passes = 0
    target.release(0)
    while len(out) < 64:
        context = [*prompt, *out]

        def next_probs(path: list[int], context: list[int] = context) -> np.ndarray:
            logits = draft.verify(0, context, path)[-1]
            z = np.exp((logits - logits.max()) / 0.5)
            return z / z.sum()

        tree = best_first_tree(next_probs, 7, 2)
        kept, token = verify_tree_greedy(tree, target.verify_tree(0, context, tree))
        assert kept == greedy_path(tree, [*(tree.tokens[k] for k in kept), token])
        target.keep_path(0, tree, kept)
        out += [tree.tokens[k] for k in kept] + [token]
        passes += 1
    assert out[:64] == reference
    assert passes < 64  # trees kept more than one token a pass somewhere


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(
            st.one_of(trees(), st.lists(st.integers(0, 4095), max_size=6)),
            st.lists(st.integers(0, 4095), min_size=1, max_size=30),
            st.integers(0, 3),
        ),
        min_size=2,
        max_size=3,
    )
)
def test_chains_and_trees_of_several_sequences_in_one_run(
    target: OnnxTarget, items: list[tuple[TokenTree | list[int], list[int], int]]
) -> None:
    """``verify_drafts`` scores each sequence's chain or tree in one run of the slot graph,
    as each would be scored alone (a part of each context cached already, or none)."""
    alone = 2
    for seq in range(alone + 1):
        target.release(seq)
    batch = []
    for seq, (draft, context, cached) in enumerate(items):
        if cached and len(context) > cached:
            target.verify(seq, context[:-cached], [])
        batch.append((seq, context, draft))
    scored = target.verify_drafts(batch)
    for seq, (draft, context, _) in enumerate(items):
        target.release(alone)
        if isinstance(draft, TokenTree):
            want = target.verify_tree(alone, context, draft)
        else:
            want = target.verify(alone, context, draft)
        assert scored[seq].shape == want.shape
        np.testing.assert_allclose(scored[seq], want, atol=2e-4)


def test_a_path_kept_from_a_batched_run_is_cached_as_a_chain(target: OnnxTarget) -> None:
    context, other = list(range(100, 140)), list(range(200, 230))
    tree = TokenTree((7, 8, 9, 10, 11), (ROOT, ROOT, 1, 2, 1))
    for seq in range(3):
        target.release(seq)
    target.verify(0, context[:-1], [])
    target.verify_drafts([(0, context, tree), (1, other, [3, 4])])
    target.keep_path(0, tree, [1, 2, 3])  # tokens 8, 9, 10
    after = target.verify(0, [*context, 8, 9, 10], [5, 6])  # only the draft is new now
    expected = target.verify(2, [*context, 8, 9, 10], [5, 6])
    np.testing.assert_allclose(after, expected, atol=2e-4)


def test_a_tree_fed_to_a_chain_runner_is_refused(target: OnnxTarget) -> None:
    from exstill_sdk.errors import InvalidArgumentError
    from exstill_sdk.execution.slots import Feed, SlotRunner

    runner = SlotRunner(target.image, target.runner)
    tree = (np.array([1]), np.ones((1, 1), bool))
    with pytest.raises(InvalidArgumentError, match="tree=True"):
        runner.run([Feed(0, np.array([5, 6]), 3, 2, tree)])
