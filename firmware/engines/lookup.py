"""Prompt-lookup drafting: continue the stream's own text after its latest matching n-gram.

Like vLLM's ngram proposer and HF prompt lookup decoding, it matches the longest suffix n-gram
(``min_n`` <= n <= ``max_n``) of the context against earlier text and proposes the tokens that
followed it; it needs no weights. Instead of scanning the context each round, it keeps an index
from every n-gram to the position after its latest occurrence, updated as tokens are committed,
so a round costs O(new tokens x n range) whatever the context length. A rollback rebuilds the
index (O(length)): rollbacks are rare, rounds are not.

The index holds positions only, as hash chains over the context (as zlib's matcher does): per
n, ``head[hash(n-gram) mod M]`` is the latest position after an n-gram of that hash and
``prev[j]`` the one before position j in the same chain; a lookup walks the chain, comparing
the context itself, to the latest position after exactly that n-gram. That is one 32-bit
integer per position and n, plus the head table (M between 2 and 4 times the length, rebuilt
when the text outgrows it): about 40 bytes per token for n = 2..4, where a dictionary of n-gram
keys took about 460.

When the match runs into the text being matched (a repeating pattern), the draft repeats the
pattern: proposed token i is the token at match + i of context + draft.
"""

from __future__ import annotations

from array import array

from exstill_sdk.errors import InvalidArgumentError

from .base import ContextState, DraftEngine, Proposal, Sampling

Entries = list[tuple[int, bytes]]
"""Per n: (position j, the n-gram before j) to index."""


class _Chains:
    """Positions after each n-gram of one n, as hash chains over the context."""

    __slots__ = ("head", "n", "prev", "width")

    def __init__(self, n: int) -> None:
        self.n, self.width = n, 4 * n
        self.head = array("i", [-1]) * 64
        self.prev = array("i", [-1]) * n  # positions below n follow no n-gram

    def add(self, entries: Entries, context: bytearray) -> None:
        """Index (j, n-gram before j) pairs: the positions right after those indexed so far."""
        if entries and entries[-1][0] >= len(self.head):  # keep chains short: grow with the text
            self._rebuild(2 * (entries[-1][0] + 1), entries[0][0], context)
        head, prev, mask = self.head, self.prev, len(self.head) - 1
        for j, key in entries:
            h = hash(key) & mask
            prev.append(head[h])  # prev[j]
            head[h] = j

    def _rebuild(self, size: int, upto: int, context: bytearray) -> None:
        """A head table of ``size`` over the positions before ``upto``."""
        size = 1 << (size - 1).bit_length()
        head, prev, mask, w = array("i", [-1]) * size, self.prev, size - 1, self.width
        for j in range(self.n, upto):
            h = hash(_take(context, 4 * j - w, 4 * j)) & mask
            prev[j] = head[h]
            head[h] = j
        self.head = head

    def find(self, key: bytes, context: bytearray) -> int | None:
        """The latest indexed position right after ``key``."""
        prev, w = self.prev, self.width
        j = self.head[hash(key) & (len(self.head) - 1)]
        while j >= 0:
            if context[4 * j - w : 4 * j] == key:
                return j
            j = prev[j]
        return None


def _take(context: bytearray, start: int, end: int | None = None) -> bytes:
    """``bytes(context[start:end])`` with one copy instead of two (a bytearray slice copies)."""
    with memoryview(context) as view:
        return bytes(view[start:end])


class LookupState(ContextState):
    def __init__(self, min_n: int, max_n: int) -> None:
        super().__init__()
        self.max_n = max_n
        self._chains = [_Chains(n) for n in range(min_n, max_n + 1)]

    @property
    def index(self) -> tuple[tuple[array, array], ...]:
        """Per n (min_n first): the chains' head table and the position links."""
        return tuple((c.head, c.prev) for c in self._chains)

    @property
    def indexed(self) -> int:
        """Positions indexed, over all n."""
        return sum(len(c.prev) - c.n for c in self._chains)

    def _entries(self, window: bytes, base: int, start: int, end: int) -> list[Entries]:
        """Per n, the entries (j, the n-gram before j) for positions start..end-1 (those with
        j >= n); ``window`` holds the tokens from position ``base`` on."""
        out = []
        for c in self._chains:
            first = max(start, c.n)
            w = c.width
            out.append(
                [(j, window[4 * (j - base) - w : 4 * (j - base)]) for j in range(first, end)]
            )
        return out

    def _extended(self, start: int, prepared: object = None) -> None:
        end = len(self.context) >> 2
        if prepared is None:
            base = max(0, start - self.max_n)
            prepared = self._entries(_take(self.context, 4 * base), base, start, end)
        for chains, entries in zip(self._chains, prepared, strict=True):  # type: ignore[call-overload]
            chains.add(entries, self.context)

    def _truncated(self, length: int) -> None:
        self._chains = [_Chains(c.n) for c in self._chains]
        self._extended(0)

    def propose(self, k: int, branch: bytes = b"") -> Proposal:
        ctx = self.context
        n_ctx = len(ctx) >> 2
        base = max(0, n_ctx - self.max_n)
        tail = _take(ctx, 4 * base) + branch
        # Drafting ahead on a branch also prepares the index entries that committing exactly
        # that branch adds, so that a prefetch hit commits without recomputing them.
        prepared = self._entries(tail, base, n_ctx, n_ctx + (len(branch) >> 2)) if branch else None
        branch_entries = prepared or [[] for _ in self._chains]
        for i in reversed(range(len(self._chains))):
            c = self._chains[i]
            if len(tail) < c.width:
                continue
            key = tail[len(tail) - c.width :]
            # the latest occurrence may lie in the branch itself, as it would once committed
            j = next((p for p, gram in reversed(branch_entries[i]) if gram == key), None)
            j = c.find(key, ctx) if j is None else j
            if j is not None:
                break
        else:
            return Proposal(b"", None, prepared)
        need = 4 * k
        if j + k <= n_ctx:
            return Proposal(_take(ctx, 4 * j, 4 * j + need), None, prepared)
        src = _take(ctx, 4 * j) + branch if j <= n_ctx else branch[4 * (j - n_ctx) :]
        return Proposal((src * (need // len(src) + 1))[:need], None, prepared)


class LookupEngine(DraftEngine):
    """The built-in weightless engine, opened by the name ``lookup``."""

    name = "lookup"

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n <= 64:
            raise InvalidArgumentError(
                f"lookup needs 1 <= min_n <= max_n <= 64, got {min_n}..{max_n}"
            )
        self.min_n = min_n
        self.max_n = max_n

    def open_state(
        self, capacity: int, sampling: Sampling, long_context: bool = False
    ) -> LookupState:
        self.check_long_context(long_context)
        return LookupState(self.min_n, self.max_n)
