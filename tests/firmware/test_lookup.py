"""The incremental prompt-lookup engine against a brute-force reference of the same rule."""

from __future__ import annotations

import struct
import tracemalloc

from exstill_firmware.engines import LookupEngine, Sampling
from exstill_firmware.engines.lookup import LAG, LookupState, _key_hash
from hypothesis import given
from hypothesis import strategies as st


def pack(tokens: list[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def unpack(data: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(data) // 4}I", data))


def reference(ctx: list[int], branch: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Longest suffix n-gram (max_n down to min_n) of ctx + branch; its latest earlier
    occurrence (the branch drafts as if committed: a prefetched draft must be the draft after
    the commit); continue from there, repeating as needed."""
    full = ctx + branch
    for n in range(max_n, min_n - 1, -1):
        if len(full) < n:
            continue
        suffix = full[-n:]
        for j in range(len(full) - 1, n - 1, -1):
            if full[j - n : j] == suffix:
                out = []
                source = list(full)
                for i in range(k):
                    source.append(source[j + i])
                    out.append(source[j + i])
                return out
    return []


small_seqs = st.lists(st.integers(0, 5), max_size=60)
lags = st.sampled_from([1, 3, 8, 256])
"""How much recent text is searched directly: 256 is the engine's own (these contexts are all
recent text then); small ones put most of the text in the hash chains."""


def lookup_state(min_n: int, max_n: int, lag: int) -> LookupState:
    return LookupState(min_n, max_n, lag)


@given(small_seqs, st.lists(st.integers(0, 5), max_size=8), st.integers(1, 10), lags)
def test_matches_reference(ctx: list[int], branch: list[int], k: int, lag: int) -> None:
    state = lookup_state(2, 4, lag)
    # commit in uneven chunks, as rounds do
    for i in range(0, len(ctx), 7):
        state.extend(pack(ctx[i : i + 7]))
    assert state.length - state.indexed < lag
    assert unpack(state.propose(k, pack(branch)).tokens) == reference(ctx, branch, k, 2, 4)


@given(small_seqs, st.integers(0, 60), small_seqs, st.integers(1, 8), lags)
def test_rollback_then_extend_matches_reference(
    ctx: list[int], cut: int, more: list[int], k: int, lag: int
) -> None:
    state = lookup_state(1, 3, lag)
    state.extend(pack(ctx))
    cut = min(cut, len(ctx))
    state.truncate(cut)
    state.extend(pack(more))
    assert state.length == cut + len(more)
    assert unpack(state.propose(k).tokens) == reference(ctx[:cut] + more, [], k, 1, 3)


@given(small_seqs, st.integers(0, 60), small_seqs)
def test_rollback_restores_the_chains_exactly(ctx: list[int], cut: int, more: list[int]) -> None:
    """Unlinking the removed positions leaves the chains that linking only the kept text
    builds."""
    cut = min(cut, len(ctx))
    rolled, fresh = lookup_state(2, 4, 1), lookup_state(2, 4, 1)
    rolled.extend(pack(ctx + more))
    rolled.truncate(cut)
    fresh.extend(pack(ctx[:cut]))
    (head, prev), (fresh_head, fresh_prev) = rolled.index, fresh.index
    if len(head) == len(fresh_head):  # the same table size: the same buckets
        assert head == fresh_head
    assert prev == fresh_prev


def test_long_text_goes_through_the_chains() -> None:
    """Past the recent text, a match is found through the chains, at its latest occurrence,
    and the head tables grow as the text does."""
    import random

    rng = random.Random(1)
    text = [rng.randrange(1000, 32000) for _ in range(5000)]
    state = LookupEngine().open_state(1 << 16, Sampling())
    for i in range(0, len(text), 5):
        state.extend(pack(text[i : i + 5]))
    assert len(text) - LAG < state.indexed <= len(text)
    head, links = state.index
    assert len(head) >= 3 * state.indexed and len(links) == 3 * state.indexed
    # a 4-gram seen at 1200 and again at 3000 (both long indexed): the later one wins
    text[3000:3004] = text[1200:1204]
    state.truncate(2990)
    state.extend(pack(text[2990:3010]))
    state.extend(pack(text[1200:1204]))
    assert unpack(state.propose(3).tokens) == text[3004:3007]
    # an n-gram seen only once, far back: the draft continues after it
    state.extend(pack(text[40:43]))
    assert unpack(state.propose(2).tokens) == text[43:45]


def test_a_match_across_token_boundaries_is_no_match() -> None:
    """The recent text is searched as bytes: an n-gram's bytes that straddle two tokens (here at
    byte 13) are skipped for the aligned occurrence before them."""
    ones = 0x01010101
    text = [ones, ones, 7, 0x01010100, ones, 0x00000001, 9, ones, ones]
    state = LookupEngine(min_n=2, max_n=2).open_state(4096, Sampling())
    state.extend(pack(text))
    assert pack(text).find(pack([ones, ones]), 1) == 13
    assert unpack(state.propose(2).tokens) == [7, 0x01010100]


def test_repeating_text_is_continued() -> None:
    state = LookupEngine().open_state(4096, Sampling())
    state.extend(pack([10, 11, 12, 13, 10, 11]))
    assert unpack(state.propose(6).tokens) == [12, 13, 10, 11, 12, 13]


def test_no_match_proposes_nothing() -> None:
    state = LookupEngine().open_state(4096, Sampling())
    state.extend(pack([1, 2, 3, 4]))
    assert state.propose(4).tokens == b""


def test_a_chain_is_walked_past_other_n_grams_of_its_bucket() -> None:
    """Two bigrams that share a bucket of the 64-bucket table: the later one heads the chain,
    and a lookup of the earlier one walks past it."""
    first = {}
    for a in range(1, 200):
        bucket = _key_hash(pack([a, a + 1])) >> 58
        if bucket in first:
            break
        first[bucket] = a
    b = first[bucket]  # [b, b + 1] and [a, a + 1] share the bucket
    state = LookupState(2, 2, lag=1)
    state.extend(pack([b, b + 1, 500, a, a + 1, 600, 700, b, b + 1]))
    assert state.indexed == state.length  # everything is in the chains: no direct search
    assert unpack(state.propose(2).tokens) == [500, a]


def test_a_commit_links_nothing_until_the_recent_text_is_full() -> None:
    """A round's commit is an append: the positions are linked in one batch once LAG have
    gathered, whatever the context length."""
    state = LookupEngine(min_n=2, max_n=4).open_state(1 << 20, Sampling())
    state.extend(pack(list(range(50000))))
    assert state.indexed == 50000  # a prefill past LAG is linked at once
    for i in range(LAG // 7):
        state.extend(pack(list(range(i * 7, i * 7 + 7))))
        assert state.indexed == 50000
    state.extend(pack(list(range(7))))
    assert state.indexed == state.length


def test_the_index_costs_tens_of_bytes_a_token() -> None:
    """It used to hold a dictionary entry per n-gram: about 460 bytes a token."""
    import random

    rng = random.Random(0)
    tokens = pack([rng.randrange(32000) for _ in range(50_000)])
    tracemalloc.start()
    try:
        state = LookupEngine(min_n=2, max_n=4).open_state(1 << 20, Sampling())
        for i in range(0, len(tokens), 4000):  # as rounds and prefills would
            state.extend(tokens[i : i + 4000])
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    per_token = held / 50_000
    assert per_token < 50  # the context itself is 4 of them
    assert unpack(state.propose(3).tokens) == []  # random text: nothing to continue
