"""Prompt-lookup drafting: continue the stream's own text after its latest matching n-gram.

Like vLLM's ngram proposer and HF prompt lookup decoding, it matches the longest suffix n-gram
(``min_n`` <= n <= ``max_n``) of the context against earlier text and proposes the tokens that
followed it; it needs no weights. Instead of scanning the context each round, it keeps an index
from every n-gram to the position after its latest occurrence, updated as tokens are committed,
so a round costs O(new tokens x n range) whatever the context length. A rollback rebuilds the
index (O(length)): rollbacks are rare, rounds are not.

When the match runs into the text being matched (a repeating pattern), the draft repeats the
pattern: proposed token i is the token at match + i of context + draft.
"""

from __future__ import annotations

from exstill_sdk.errors import InvalidArgumentError

from .base import ContextState, DraftEngine, Proposal, Sampling


class LookupState(ContextState):
    def __init__(self, min_n: int, max_n: int) -> None:
        super().__init__()
        self.min_n = min_n
        self.max_n = max_n
        self._widths = tuple(4 * n for n in range(min_n, max_n + 1))
        self.index: dict[bytes, int] = {}

    def _entries(self, window: bytes, base: int, start: int, end: int) -> list[tuple[bytes, int]]:
        """Index entries (the n-gram before position j -> j) for positions start..end-1;
        ``window`` holds the tokens from position ``base`` on."""
        out: list[tuple[bytes, int]] = []
        for w in self._widths:
            first = max(start, w >> 2)  # the n-gram before position j needs j >= n
            if first < end:
                offsets = range(4 * (first - base), 4 * (end - base), 4)
                # In order of j, so that each n-gram keeps its latest position.
                out += zip([window[o - w : o] for o in offsets], range(first, end), strict=True)
        return out

    def _extended(self, start: int, prepared: object = None) -> None:
        if prepared is None:
            base = max(0, start - self.max_n)
            window = bytes(self.context[4 * base :])
            prepared = self._entries(window, base, start, len(self.context) >> 2)
        self.index.update(prepared)  # type: ignore[call-overload]

    def _truncated(self, length: int) -> None:
        self.index = {}
        self._extended(0)

    def propose(self, k: int, branch: bytes = b"") -> Proposal:
        ctx = self.context
        n_ctx = len(ctx) >> 2
        base = max(0, n_ctx - self.max_n)
        tail = bytes(ctx[4 * base :]) + branch
        # Drafting ahead on a branch also prepares the index entries that committing exactly
        # that branch adds, so that a prefetch hit commits without recomputing them.
        prepared = self._entries(tail, base, n_ctx, n_ctx + (len(branch) >> 2)) if branch else None
        index = self.index
        for w in reversed(self._widths):
            if len(tail) < w:
                continue
            j = index.get(tail[len(tail) - w :])
            if j is not None:
                break
        else:
            return Proposal(b"", None, prepared)
        need = 4 * k
        if j + k <= n_ctx:
            return Proposal(bytes(ctx[4 * j : 4 * j + need]), None, prepared)
        src = bytes(ctx[4 * j :]) + branch
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
