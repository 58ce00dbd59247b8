"""The acceptance measure against a decoder simulated pass by pass."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from exstill_sdk.evaluation.acceptance import (
    COVERAGE_KS,
    fastest_decode,
    rounds,
    runs_from_chains,
    runs_from_matches,
)
from exstill_sdk.evaluation.drafters import target_ranks
from exstill_sdk.evaluation.trees import tree_passes
from exstill_sdk.speculative.trees import TokenTree


def _decode(text: list[int], prompt_len: int, predict: dict[int, int], k: int) -> tuple[int, list]:
    """Greedy speculative decoding of ``text[prompt_len:]`` as a decoder runs it: the draft
    chains its own predictions (a function of the last token), the target keeps the run that
    equals its text and adds its own token. Returns the passes and each pass's accepted count."""
    t, passes, accepted = prompt_len, 0, []
    while t < len(text):
        chain, last = [], text[t - 1]
        for _ in range(min(k, len(text) - 1 - t)):
            last = predict.get(last, -1)
            chain.append(last)
        a = 0
        while a < len(chain) and chain[a] == text[t + a]:
            a += 1
        accepted.append(a)
        passes += 1
        t += a + 1
    return passes, accepted


@settings(max_examples=300, deadline=None)
@given(
    text=st.lists(st.integers(0, 4), min_size=2, max_size=60),
    table=st.dictionaries(st.integers(0, 4), st.integers(0, 4)),
    k=st.integers(1, 8),
)
def test_one_teacher_forced_pass_gives_every_chain(text, table, k) -> None:
    """The draft's prediction at each position given the target's own prefix (one pass) gives
    the same passes as drafting chain after chain."""
    prompt_len = 1
    y = np.array(text[prompt_len:])
    predicted = np.array([table.get(text[j - 1], -1) for j in range(prompt_len, len(text))])
    ranks = np.where(predicted == y, 0, 1)
    r = rounds(runs_from_matches(ranks == 0, k), k, ranks)
    passes, accepted = _decode(text, prompt_len, table, k)
    assert r.passes == passes and r.tokens == len(y)
    assert r.accepted.sum() == sum(accepted)
    assert 1.0 <= r.tau <= k + 1
    for depth in range(1, k + 1):
        assert r.accepted[depth - 1] == sum(a >= depth for a in accepted)
    assert np.array_equal(r.covered[0], r.accepted)  # top-1 coverage is acceptance
    assert all(np.all(r.covered[i] >= r.covered[0]) for i in range(len(COVERAGE_KS)))
    checked = max(int(r.reached.sum()), 1)
    assert r.top_k[0] == r.accepted.sum() / checked  # over every depth reached
    assert r.top_k[1:] == [r.reached.sum() / checked] * (len(COVERAGE_KS) - 1)  # ranks 0 or 1

    def chain_at(t: int) -> TokenTree:  # the same chains as trees, for exstill eval's tree walk
        chain, last = [], text[prompt_len + t - 1]
        for _ in range(k):
            last = table.get(last, -1)
            chain.append(last if last >= 0 else 99)  # -1: no prediction, never kept
        return TokenTree.chain(chain)

    assert tree_passes(chain_at, list(y)) == passes


@given(matches=st.lists(st.booleans(), min_size=1, max_size=80), k=st.integers(1, 7))
def test_a_longer_draft_never_needs_more_passes(matches, k) -> None:
    runs = runs_from_matches(np.array(matches), 8)
    assert rounds(runs, k + 1).passes <= rounds(runs, k).passes


def test_known_answers() -> None:
    n = 20
    perfect = runs_from_matches(np.ones(n, dtype=bool), 8)
    for k in range(1, 9):
        assert rounds(perfect, k).passes == math.ceil(n / (k + 1))
    hopeless = runs_from_matches(np.zeros(n, dtype=bool), 8)
    assert rounds(hopeless, 4).tau == 1.0
    assert list(runs_from_matches(np.array([1, 1, 0, 1, 1, 1], dtype=bool), 2)) == [
        2,
        1,
        0,
        2,
        2,
        1,
    ]


def test_chains_are_scored_from_their_own_start() -> None:
    y = np.array([5, 6, 7, 8])
    assert list(runs_from_chains([[5, 6, 9], [], [7, 8, 1], [0]], y)) == [2, 0, 2, 0]


def test_target_ranks_count_the_tokens_scored_strictly_higher() -> None:
    logits = np.array([[0.1, 0.9, 0.5, 0.9], [2.0, -1.0, 0.0, 1.0]], np.float32)
    assert list(target_ranks(logits, [1, 1])) == [0, 3]  # a tie above it does not count
    assert list(target_ranks(logits, [0, 3])) == [3, 1]


def _cheapest(runs: list[int], costs: list[float], t: int = 0) -> float:
    """Every schedule of draft lengths tried: the least cost from position t on."""
    if t >= len(runs):
        return 0.0
    run = min(runs[t], len(runs) - 1 - t)
    return min(costs[k] + _cheapest(runs, costs, t + min(run, k) + 1) for k in range(len(costs)))


@settings(max_examples=200, deadline=None)
@given(
    runs=st.lists(st.integers(0, 4), min_size=1, max_size=9),
    costs=st.lists(st.floats(0.5, 3.0), min_size=4, max_size=4),
)
def test_fastest_decode_is_the_cheapest_schedule_and_beats_every_fixed_k(
    runs: list[int], costs: list[float]
) -> None:
    """Costs as a noisy verify curve measures them: not always growing with K. A fixed K's
    passes are charged that K each, as the pair's limit charges them."""
    best = fastest_decode(np.array(runs), np.array(costs))
    assert math.isclose(best, _cheapest(runs, costs), abs_tol=1e-9)
    for k in range(1, len(costs)):
        assert best <= rounds(np.array(runs), k).passes * costs[k] + 1e-9
    assert best <= len(runs) * costs[0] + 1e-9  # plain steps only
