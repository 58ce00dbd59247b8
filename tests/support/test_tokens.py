"""exstill_sdk.support.tokens: the one common-prefix helper, and a target's cache record that
looks only at new tokens, checked against brute force."""

from __future__ import annotations

import struct

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from exstill_sdk.support.tokens import CHECK_WINDOW, CachedTokens, common_prefix, continues

tokens = st.lists(st.integers(0, 5), max_size=80)


def brute(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@given(tokens, tokens)
def test_common_prefix_of_card_bytes_and_arrays(a: list[int], b: list[int]) -> None:
    packed = [struct.pack(f"<{len(x)}I", *x) for x in (a, b)]
    assert common_prefix(*packed) == brute(a, b)
    assert common_prefix(np.array(a, np.int64), np.array(b, np.int64)) == brute(a, b)


@given(
    st.lists(tokens, min_size=1, max_size=1),
    st.lists(
        st.tuples(
            st.integers(0, 200),
            tokens,
            st.lists(st.integers(0, 5), max_size=8),
            st.one_of(st.none(), st.integers(1, CHECK_WINDOW)),
        ),
        max_size=12,
    ),
)
def test_cached_tokens_under_the_decoders_contract(
    prompt: list[list[int]], rounds: list[tuple[int, list[int], list[int], int | None]]
) -> None:
    """The decoder's way: roll back to what it keeps, then extend; sometimes a token within the
    check window is changed without a rollback. Either way the target is told to compute from
    a position where what it holds still matches, and ends up holding context + draft."""
    cache = CachedTokens()
    context = [*prompt[0], 1]
    for keep, new, draft, rewrite in rounds:
        held = list(cache.tokens)
        start, tail = cache.advance(context, draft)
        assert start <= min(brute(held, context), len(context) - 1)
        assert held[:start] == context[:start] and tail == [*context[start:], *draft]
        assert cache.tokens == [*context, *draft]
        keep = min(keep, len(cache.tokens))
        cache.rollback(keep)
        context = [*cache.tokens, *new] or [0]
        if rewrite is not None and len(cache.tokens) >= rewrite:
            context[len(cache.tokens) - rewrite] += 1


def test_a_lawful_round_looks_only_at_new_tokens() -> None:
    cache = CachedTokens()
    context = list(range(16000))
    cache.advance(context, [1, 2, 3])
    cache.rollback(16001)  # the decoder keeps the first draft token, then adds its bonus
    context += [1, 7]
    start, tail = cache.advance(context, [8, 9])
    assert (start, tail) == (16001, [7, 8, 9])
    # a token rewritten without a rollback, within the check window: caught, and a full
    # comparison finds where to compute from
    context[-5] = -1
    start, _ = cache.advance(context, [])
    assert start == len(context) - 5
    assert not continues(list(range(100)), 100, [*range(100 - CHECK_WINDOW), -1, *range(99)])
