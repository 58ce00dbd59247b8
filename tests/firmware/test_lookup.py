"""The incremental prompt-lookup engine against a brute-force reference of the same rule."""

from __future__ import annotations

import struct
import tracemalloc

from exstill_firmware.engines import LookupEngine, Sampling
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


@given(small_seqs, st.lists(st.integers(0, 5), max_size=8), st.integers(1, 10))
def test_matches_reference(ctx: list[int], branch: list[int], k: int) -> None:
    engine = LookupEngine(min_n=2, max_n=4)
    state = engine.open_state(4096, Sampling())
    # commit in uneven chunks, as rounds do
    for i in range(0, len(ctx), 7):
        state.extend(pack(ctx[i : i + 7]))
    assert unpack(state.propose(k, pack(branch)).tokens) == reference(ctx, branch, k, 2, 4)


@given(small_seqs, st.integers(0, 60), small_seqs, st.integers(1, 8))
def test_rollback_then_extend_matches_reference(
    ctx: list[int], cut: int, more: list[int], k: int
) -> None:
    state = LookupEngine(min_n=1, max_n=3).open_state(4096, Sampling())
    state.extend(pack(ctx))
    cut = min(cut, len(ctx))
    state.truncate(cut)
    state.extend(pack(more))
    assert state.length == cut + len(more)
    assert unpack(state.propose(k).tokens) == reference(ctx[:cut] + more, [], k, 1, 3)


def test_repeating_text_is_continued() -> None:
    state = LookupEngine().open_state(4096, Sampling())
    state.extend(pack([10, 11, 12, 13, 10, 11]))
    assert unpack(state.propose(6).tokens) == [12, 13, 10, 11, 12, 13]


def test_no_match_proposes_nothing() -> None:
    state = LookupEngine().open_state(4096, Sampling())
    state.extend(pack([1, 2, 3, 4]))
    assert state.propose(4).tokens == b""


def test_index_is_incremental() -> None:
    """A round adds a bounded number of entries, whatever the context length."""
    state = LookupEngine(min_n=2, max_n=4).open_state(1 << 20, Sampling())
    state.extend(pack(list(range(50000))))
    before = state.indexed
    state.extend(pack([7, 8, 9, 10, 11, 12, 13]))
    assert state.indexed - before == 7 * 3


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
    assert per_token < 70  # the context itself is 4 of them
    assert unpack(state.propose(3).tokens) == []  # random text: nothing to continue


@given(small_seqs, st.lists(st.integers(0, 5), min_size=1, max_size=8), st.integers(1, 8))
def test_prepared_commit_equals_plain_commit(ctx: list[int], branch: list[int], k: int) -> None:
    """The index entries prepared while drafting ahead on a branch are exactly those that
    committing the branch computes."""
    engine = LookupEngine(min_n=2, max_n=4)
    ahead, plain = engine.open_state(4096, Sampling()), engine.open_state(4096, Sampling())
    ahead.extend(pack(ctx))
    plain.extend(pack(ctx))
    proposal = ahead.propose(k, pack(branch))
    assert proposal.prepared is not None
    ahead.extend(pack(branch), proposal.prepared)
    plain.extend(pack(branch))
    assert ahead.index == plain.index
    assert ahead.propose(k).tokens == plain.propose(k).tokens
