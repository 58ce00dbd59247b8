"""Prompt-lookup drafting: continue the stream's own text after its latest matching n-gram.

Like vLLM's ngram proposer and HF prompt lookup decoding, it matches the longest suffix n-gram
(``min_n`` <= n <= ``max_n``) of the context against earlier text and proposes the tokens that
followed it; it needs no weights. When the match runs into the text being matched (a repeating
pattern), the draft repeats the pattern: proposed token i is the token at match + i of
context + draft.

Where it looks, so that a round costs the same whatever the context length:
- **The recent text** (at most ``LAG`` tokens, plus a branch being drafted ahead on) is searched
  directly, with ``bytes.rfind`` on the u32 wire bytes: one C scan, no per-token Python work.
  A round's commit is a bytearray append.
- **The older text** is indexed as hash chains over positions (as zlib's matcher does): per n,
  ``head[bucket(n-gram)]`` is the latest position after an n-gram of that bucket and
  ``prev[j]`` the one before position j in the same chain; a lookup walks the chain, comparing
  the context itself. Once ``LAG`` tokens have gathered unindexed, they are indexed in one
  numpy batch (a polynomial hash per n-gram, chains linked by a stable sort), so the per-token
  cost of indexing is numpy's, not the interpreter's.

That is one int32 per position and n, plus a head table of 1 to 2 entries a position: 30 to
45 bytes a token for n = 2..4, the context included (a dictionary of n-gram keys took about
460). A rollback unlinks the positions it removes (O(tokens removed)), restoring the chains
exactly.
"""

from __future__ import annotations

import itertools
import struct
from array import array
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from exstill_sdk.errors import InvalidArgumentError
from exstill_sdk.protocol.constants import TREE_ROOT
from exstill_sdk.protocol.messages import TreeRequest

from .base import ContextState, DraftEngine, Proposal, Sampling, TreeProposal

LAG = 256
"""Most committed tokens left unindexed: the recent text a round searches directly."""

_P = 0x100000001B3  # polynomial base of the n-gram hash (FNV's prime)
_MIX = 0x9E3779B97F4A7C15  # Fibonacci hashing: the top bits pick the bucket
_MASK64 = (1 << 64) - 1
_KEYS = {n: struct.Struct(f"<{n}I") for n in range(1, 65)}


def _key_hash(key: bytes | bytearray) -> int:
    """The 64-bit hash of one n-gram given as wire bytes (as ``_Chains.link`` computes it)."""
    h = 0
    for t in _KEYS[len(key) >> 2].unpack(key):
        h = (h * _P + t) & _MASK64
    return (h * _MIX) & _MASK64


class _Chains:
    """For each n, the positions after each n-gram, as hash chains over the context.

    One table serves every n: bucket ``c * size + (hash >> shift)`` for the c-th n, and
    position j's link at ``prev[j * ns + c]``. Plain arrays, so that a lookup reads them at
    interpreter speed; linking writes them through numpy views, one batch for all n at once.
    """

    __slots__ = ("head", "ns", "prev", "shift", "size")

    def __init__(self, ns: tuple[int, ...]) -> None:
        self.ns = ns
        self.prev = array("i")
        self._resize(0)

    def _resize(self, positions: int) -> None:
        """An empty head table of 1 to 2 buckets a position for each n."""
        bits = max(6, (positions - 1).bit_length())
        self.size, self.shift = 1 << bits, 64 - bits
        self.head = array("i", [-1]) * (self.size * len(self.ns))

    def _batch(
        self, context: bytearray, first: int, end: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Positions first..end-1 of every n (those at or after n): each one's bucket, link
        slot and position, oldest first within each n."""
        max_n = self.ns[-1]
        base = max(0, first - max_n)
        tokens = np.frombuffer(context, np.uint32, end - base, 4 * base).astype(np.uint64)
        shift, out_b, out_s, out_j = np.uint64(self.shift), [], [], []
        h = np.zeros(len(tokens), np.uint64)
        p = np.uint64(_P)
        for n in range(1, max_n + 1):  # h[i]: the hash of tokens[i : i + n]
            h = h[: len(tokens) - n + 1] * p + tokens[n - 1 :]
            if n not in self.ns:
                continue
            c = self.ns.index(n)
            lo = max(first, n)
            if lo >= end:
                continue
            grams = h[lo - n - base : end - n - base]  # the n-grams before positions lo..end-1
            out_b.append(((grams * np.uint64(_MIX)) >> shift).astype(np.intp) + c * self.size)
            j = np.arange(lo, end, dtype=np.intp)
            out_j.append(j)
            out_s.append(j * len(self.ns) + c)
        if not out_b:
            empty = np.empty(0, np.intp)
            return empty, empty, empty
        return np.concatenate(out_b), np.concatenate(out_s), np.concatenate(out_j)

    def link(self, context: bytearray, first: int, end: int) -> None:
        """Link positions first..end-1 (the next ones), as one insertion after another would;
        the head table grows first when the text outgrows it, and then every position is
        linked again."""
        if end > self.size:
            self._resize(end)
            first = 0
        room = end * len(self.ns) - len(self.prev)
        if room > 0:
            self.prev.extend(array("i", [-1]) * max(room, len(self.prev) // 4))
        buckets, slots, positions = self._batch(context, first, end)
        if not len(buckets):
            return
        order, starts = _by_bucket(buckets)
        b, s, j = buckets[order], slots[order], positions[order]
        before = np.empty(len(b), np.intp)
        before[1:] = j[:-1]
        head = np.frombuffer(self.head, np.int32)
        # The oldest new position of a bucket follows its old head, the others the new
        # position before them. prev is written before head, so that a reader on the prefetch
        # worker never follows a link that is not there yet.
        np.frombuffer(self.prev, np.int32)[s] = np.where(starts, head[b], before)
        ends = np.empty(len(b), bool)
        ends[-1] = True
        ends[:-1] = starts[1:]
        head[b[ends]] = j[ends]

    def unlink(self, context: bytearray, first: int, end: int) -> None:
        """Remove positions first..end-1 (the newest ones): each bucket's head goes back to
        what preceded its oldest removed position."""
        buckets, slots, _ = self._batch(context, first, end)
        if not len(buckets):
            return
        order, starts = _by_bucket(buckets)
        prev = np.frombuffer(self.prev, np.int32)
        np.frombuffer(self.head, np.int32)[buckets[order][starts]] = prev[slots[order][starts]]

    def find(self, c: int, key: bytes | bytearray, context: bytearray) -> int | None:
        """The latest linked position right after ``key``, an n-gram of the c-th n."""
        return next(self.find_all(c, key, context), None)

    def find_all(self, c: int, key: bytes | bytearray, context: bytearray) -> Iterator[int]:
        """Every linked position right after ``key``, an n-gram of the c-th n, latest first."""
        prev, w, ns = self.prev, len(key), len(self.ns)
        j = self.head[c * self.size + (_key_hash(key) >> self.shift)]
        while j >= 0:
            if context[4 * j - w : 4 * j] == key:
                yield j
            j = prev[j * ns + c]


def _by_bucket(buckets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the order that groups a non-empty batch by bucket, each bucket's positions oldest
    first; where each group starts in that order)."""
    order = np.argsort(buckets, kind="stable")
    b = buckets[order]
    starts = np.empty(len(b), bool)
    starts[0] = True
    np.not_equal(b[1:], b[:-1], out=starts[1:])
    return order, starts


def _rfind_aligned(text: bytes | bytearray, key: bytes | bytearray, end: int) -> int:
    """The highest token-aligned offset of ``key`` in ``text[:end]``, or -1."""
    at = text.rfind(key, 0, end)
    while at > 0 and at & 3:
        at = text.rfind(key, 0, at + len(key) - 1)
    return at


class LookupState(ContextState):
    def __init__(self, min_n: int, max_n: int, lag: int = LAG, greedy: bool = True) -> None:
        super().__init__()
        self.ns = tuple(range(min_n, max_n + 1))
        self.lag = lag
        self.greedy = greedy
        """A sampled stream's trees are chains: lookup's branches would be no draws from one
        distribution, which sampled verification of siblings needs."""
        self._chains = _Chains(self.ns)
        self._linked = 0
        """Positions 0..linked-1 are in the chains (for each n, those at or after n)."""

    @property
    def indexed(self) -> int:
        """Positions in the chains; the newest ``length - indexed`` (fewer than ``lag``) are
        searched directly."""
        return self._linked

    @property
    def index(self) -> tuple[list[int], list[int]]:
        """The chains' head table and the links of the positions in them."""
        c = self._chains
        return c.head.tolist(), c.prev[: self._linked * len(self.ns)].tolist()

    def _extended(self, start: int) -> None:
        length = len(self.context) >> 2
        if length - self._linked >= self.lag:
            self._chains.link(self.context, self._linked, length)
            self._linked = length

    def _truncating(self, length: int) -> None:
        """Unlink positions length..linked-1, whose n-grams the context still holds."""
        if length < self._linked:
            self._chains.unlink(self.context, length, self._linked)
            self._linked = length

    def propose(self, k: int, branch: bytes = b"") -> Proposal:
        view = self._view(branch)
        j = next(self._matches(view), None)
        return Proposal(b"" if j is None else view.follow(j, k))

    def propose_tree(self, shape: TreeRequest) -> TreeProposal:
        """Several earlier matches as branches: the continuations of the ``top_k`` latest
        matching positions (longest n-gram first), merged where they agree, laid down a level
        at a time across them until ``nodes`` nodes (each at most ``depth`` deep)."""
        view = self._view(b"")
        depth = shape.levels
        found = itertools.islice(self._matches(view), shape.top_k if self.greedy else 1)
        paths = [view.follow(j, depth) for j in found]
        tokens, parents = bytearray(), bytearray()
        children: dict[tuple[int, bytes], int] = {}
        ends = [-1] * len(paths)  # each path's node so far
        for level in range(depth):
            for i, path in enumerate(paths):
                token = path[4 * level : 4 * level + 4]
                if not token or (ends[i] < -1):
                    ends[i] = -2  # this path ended
                    continue
                node = children.get((ends[i], token))
                if node is None:
                    if len(parents) == shape.nodes:
                        return TreeProposal(bytes(tokens), bytes(parents))
                    node = children[(ends[i], token)] = len(parents)
                    tokens += token
                    parents.append(TREE_ROOT if ends[i] < 0 else ends[i])
                ends[i] = node
        return TreeProposal(bytes(tokens), bytes(parents))

    def _view(self, branch: bytes) -> _View:
        ctx = self.context
        n_ctx = len(ctx) >> 2
        linked = min(self._linked, n_ctx)  # the worker may read while a rollback runs
        base = max(0, linked - self.ns[-1])
        # Runs on the prefetch worker too: slices, never a view of the context, whose next
        # append would fail while a view is held.
        return _View(ctx, n_ctx, linked, base, ctx[4 * base : 4 * n_ctx] + branch, branch)

    def _matches(self, view: _View) -> Iterator[int]:
        """The positions after an earlier occurrence of the text's latest n-gram, longest n
        first, latest first within an n: the recent text, then the chains; each once."""
        recent, base = view.recent, view.base
        end = len(recent) - 4  # an n-gram followed by a token of context + branch
        seen: set[int] = set()
        for c in reversed(range(len(self.ns))):
            n = self.ns[c]
            if len(recent) < 4 * n:
                continue
            key = recent[-4 * n :]
            at = _rfind_aligned(recent, key, end)
            while at >= 0:
                j = base + (at >> 2) + n
                if j not in seen:
                    seen.add(j)
                    yield j
                at = _rfind_aligned(recent, key, at + len(key) - 4) if at else -1
            if view.linked > n:
                for j in self._chains.find_all(c, key, view.context):
                    if j not in seen:
                        seen.add(j)
                        yield j


class _View(NamedTuple):
    """The text a lookup searches: the context, with the newest tokens (from ``base`` on,
    and any branch drafted ahead on) as one ``recent`` bytes."""

    context: bytearray
    n_ctx: int
    linked: int
    base: int
    recent: bytes | bytearray
    branch: bytes

    def follow(self, j: int, k: int) -> bytes:
        """The ``k`` tokens from position ``j`` on; a match that runs into the text being
        matched repeats its pattern."""
        ctx, need = self.context, 4 * k
        if j + k <= self.n_ctx:
            return bytes(ctx[4 * j : 4 * j + need])
        src = (
            self.recent[4 * (j - self.base) :]
            if j >= self.base
            else ctx[4 * j : 4 * self.n_ctx] + self.branch
        )
        return bytes((src * (need // len(src) + 1))[:need])


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
        return LookupState(self.min_n, self.max_n, greedy=sampling.greedy)
