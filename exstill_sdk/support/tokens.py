"""Token sequences as the host and the card keep them: how much two share, and a target's
record of what its KV cache holds.

Every round a target is handed the whole context so far, up to 16K tokens. Walking all of it
every round would make the host's cost grow with the context; instead a cache is trusted to
hold what it was last given, less what was rolled back, and only the new tail (plus a short
window before it, as a check) is looked at.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

CHECK_WINDOW = 32
"""Tokens before the new tail compared against the cache, to catch a caller that changed its
history without a rollback (it then pays a full comparison)."""


def common_prefix(a: bytes | bytearray | np.ndarray, b: bytes | bytearray | np.ndarray) -> int:
    """How many leading tokens ``a`` and ``b`` share: u32 token bytes (as the card keeps a
    stream), or two numpy arrays of one dtype. C-speed slice comparisons and a binary search,
    so a long shared prefix costs a few memcmp passes, not a Python loop."""
    va: memoryview
    vb: memoryview
    if isinstance(a, np.ndarray):
        itemsize = a.itemsize
        va = np.ascontiguousarray(a).data.cast("B")
        vb = np.ascontiguousarray(b, a.dtype).data.cast("B")
    else:
        assert not isinstance(b, np.ndarray)
        itemsize = 4
        va, vb = memoryview(a), memoryview(b)
    n = min(len(va), len(vb)) // itemsize
    if va[: itemsize * n] == vb[: itemsize * n]:
        return n
    lo, hi = 0, n  # a and b agree on lo tokens and differ within hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if va[: itemsize * mid] == vb[: itemsize * mid]:
            lo = mid
        else:
            hi = mid
    return lo


def continues(
    held: Sequence[int] | np.ndarray, length: int, tokens: Sequence[int] | np.ndarray
) -> bool:
    """Whether ``tokens`` (at least ``length`` long) continues the first ``length`` tokens of
    ``held``, judged by the last CHECK_WINDOW of them: O(window), whatever the length."""
    if len(tokens) < length:
        return False
    start = max(0, length - CHECK_WINDOW)
    if isinstance(held, np.ndarray) or isinstance(tokens, np.ndarray):
        return bool(np.array_equal(held[start:length], tokens[start:length]))
    return list(tokens[start:length]) == list(held[start:length])


class CachedTokens:
    """The tokens one sequence's KV cache holds, for a target that reuses it between rounds.

    ``advance(context, draft)`` says from which position the target must compute to score
    ``draft`` after ``context``, and records ``context + draft`` as cached. The decoder's
    contract keeps this O(new tokens): it rolls the cache back to what it keeps (``rollback``)
    and then only appends, so the context starts with what is cached. A caller that rewrote
    earlier tokens without a rollback is caught by the check window and pays one full
    comparison."""

    __slots__ = ("tokens",)

    def __init__(self) -> None:
        self.tokens: list[int] = []

    def advance(self, context: Sequence[int], draft: Sequence[int]) -> tuple[int, list[int]]:
        """(start, the tokens from ``start`` on): position ``start`` onwards must be computed;
        at least the last context token is, so its logits score the draft's first token."""
        held = self.tokens
        n = min(len(held), len(context))
        if not continues(held, n, context):
            n = common_prefix(np.asarray(held[:n], np.int64), np.asarray(context[:n], np.int64))
        start = min(n, len(context) - 1)
        del held[start:]
        tail = [*context[start:], *draft]
        held += tail
        return start, tail

    def rollback(self, length: int) -> None:
        del self.tokens[length:]
