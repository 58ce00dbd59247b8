"""A card image run as the *target* on the host CPU with onnxruntime (no torch needed).

The same graph the card's engine runs (exstill_sdk.execution.graph), with one KV row per
sequence. ``verify_batch`` scores every sequence of a round in one onnxruntime run (the slot
graph, exstill_sdk.execution.slots): on a target bound by reading its weights, that is what
makes several users cost little more than one. ``greedy(prompt, n)`` is the plain greedy loop,
the reference a speculative decoder must reproduce; ``greedy_batch`` decodes several prompts
with one run a step, the plain baseline for several users. ``verify_tree`` scores a token tree
in one run (the tree graph, exstill_sdk.execution.trees) and ``keep_path`` keeps the accepted
path's cache entries; ``verify_drafts`` scores several sequences' chains and trees in one run
(the slot graph with each slot's own positions and attention bias).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from exstill_sdk.errors import InvalidArgumentError
from exstill_sdk.execution.runner import MAX_CHUNK, OnnxDecoder
from exstill_sdk.execution.slots import Feed, SlotRunner
from exstill_sdk.execution.trees import TreeRunner, keep_path
from exstill_sdk.image.reader import CardImage, open_image
from exstill_sdk.speculative.adapter import TargetAdapter
from exstill_sdk.speculative.trees import TokenTree
from exstill_sdk.support.tokens import CachedTokens
from exstill_sdk.support.trees import ancestry, depths


class OnnxTarget(TargetAdapter):
    def __init__(
        self,
        image: CardImage | str | Path,
        max_sequences: int = 1,
        positions: int = 4096,
        threads: int = 0,
    ) -> None:
        self.image = image if isinstance(image, CardImage) else open_image(image, verify=True)
        if self.image.arch.head_size:
            raise InvalidArgumentError(
                f"image {self.image.target!r} has a frequency-ranked head "
                f"({self.image.arch.head_size} of {self.image.arch.vocab_size} tokens): it is a "
                "draft and cannot be a target, whose every token must be scorable"
            )
        self.runner = OnnxDecoder(self.image, max_sequences, positions, threads)
        self.vocab_size = self.image.arch.vocab_size
        self.eos_token_ids = tuple(self.image.tokenizer.special_ids.get("eos", ()))
        self.tokenizer = self.image.tokenizer
        self.positions = positions
        self.max_positions = positions
        self.threads = threads
        self.max_batch = max_sequences
        self.supports_trees = True
        self._slots: SlotRunner | None = None
        """The slot graph's session, opened on the first batch of several sequences."""
        self._tree_slots: SlotRunner | None = None
        """The slot graph with trees, opened on the first batch that holds a tree."""
        self._trees: TreeRunner | None = None
        """The tree graph's session, opened on the first tree scored alone."""
        self._rows: dict[int, int] = {}
        self._cached: dict[int, CachedTokens] = {}
        self._free = list(range(max_sequences))

    def _row(self, seq_id: int) -> int:
        row = self._rows.get(seq_id)
        if row is None:
            if not self._free:
                raise InvalidArgumentError(
                    f"the ONNX target holds {len(self._rows)} sequences already; "
                    "create it with a larger max_sequences"
                )
            row = self._rows[seq_id] = min(self._free)
            self._free.remove(row)
            self._cached[seq_id] = CachedTokens()
        return row

    def _tail(
        self, seq_id: int, context: Sequence[int], draft: Sequence[int]
    ) -> tuple[int, int, list[int]]:
        """The sequence's row, and from which cache position which tokens it must be fed."""
        row = self._row(seq_id)
        if len(context) + len(draft) > self.positions:
            raise InvalidArgumentError(
                f"{len(context) + len(draft)} tokens exceed the ONNX target's {self.positions} "
                "positions"
            )
        start, tail = self._cached[seq_id].advance(context, draft)  # O(new tokens)
        return row, start, tail

    def verify(self, seq_id: int, context: Sequence[int], draft: Sequence[int]) -> np.ndarray:
        row, start, tail = self._tail(seq_id, context, draft)
        return self.runner.prefill(row, np.asarray(tail, np.int64), start, last=len(draft) + 1)

    def verify_batch(
        self, items: Sequence[tuple[int, Sequence[int], Sequence[int]]]
    ) -> list[np.ndarray]:
        """Every sequence's round in one run over the weights (a long new context, such as a
        prompt, is fed ahead on its own in chunks, all but its last MAX_CHUNK tokens)."""
        if len(items) < 2:
            return super().verify_batch(items)
        if self._slots is None:
            self._slots = SlotRunner(self.image, self.runner, self.threads)
        return self._slots.run([self._feed(*item)[0] for item in items])

    def verify_drafts(
        self, items: Sequence[tuple[int, Sequence[int], Sequence[int] | TokenTree]]
    ) -> list[np.ndarray]:
        """Chains and trees of several sequences in one run (a lone tree: ``verify_tree``)."""
        if len(items) < 2 or not any(isinstance(draft, TokenTree) for _, _, draft in items):
            return super().verify_drafts(items)
        if self._tree_slots is None:
            self._tree_slots = SlotRunner(self.image, self.runner, self.threads, tree=True)
        feeds, firsts = zip(*(self._feed(*item) for item in items), strict=True)
        out = self._tree_slots.run(feeds)
        return [
            x if first is None else np.concatenate([first, x])
            for x, first in zip(out, firsts, strict=True)
        ]

    def _feed(
        self, seq_id: int, context: Sequence[int], draft: Sequence[int] | TokenTree
    ) -> tuple[Feed, np.ndarray | None]:
        """A sequence's part of a batched run: the context not cached and the draft (a tree's
        nodes after the context, the context's last token fed with them), context beyond the
        run's last MAX_CHUNK tokens fed ahead on its own; and, for a tree after a context
        that had nothing cached (a tree's run needs a cached token), the context fed ahead
        and its last logits."""
        tree = draft if isinstance(draft, TokenTree) and len(draft) else None
        chain = () if isinstance(draft, TokenTree) else draft
        row, start, tail = self._tail(seq_id, context, chain)
        ahead = max(0, len(tail) - MAX_CHUNK)
        first = None
        if tree is not None and start == 0:
            first = self.runner.prefill(row, np.asarray(tail, np.int64), 0)
            ahead = len(tail)
        elif ahead:
            self.runner.prefill(row, np.asarray(tail[:ahead], np.int64), start)
        tokens = np.asarray(tail[ahead:], np.int64)
        if tree is None:
            return Feed(row, tokens, start + ahead, len(chain) + 1), None
        feed = Feed(
            row,
            np.concatenate([tokens, np.asarray(tree.tokens, np.int64)]),
            start + ahead,
            len(tree) + (first is None),
            (np.asarray(depths(tree.parents), np.int64), ancestry(tree.parents)),
        )
        return feed, first

    def verify_tree(self, seq_id: int, context: Sequence[int], tree: TokenTree) -> np.ndarray:
        row, start, prefix = self._tail(seq_id, context, ())
        if self._trees is None:
            self._trees = TreeRunner(self.image, self.runner, self.threads)
        return self._trees.run(row, start, prefix, tree.tokens, tree.parents)

    def keep_path(self, seq_id: int, tree: TokenTree, nodes: Sequence[int]) -> None:
        if seq_id not in self._rows:
            raise InvalidArgumentError(f"sequence {seq_id} has no scored tree to keep a path of")
        cached = self._cached[seq_id]
        keep_path(self.runner, self._rows[seq_id], len(cached.tokens), nodes)
        cached.tokens += [tree.tokens[i] for i in nodes]

    def rollback(self, seq_id: int, length: int) -> None:
        cached = self._cached.get(seq_id)
        if cached is not None:
            cached.rollback(length)

    def release(self, seq_id: int) -> None:
        row = self._rows.pop(seq_id, None)
        if row is not None:
            self._free.append(row)
            self._cached.pop(seq_id, None)

    def greedy(self, prompt: Sequence[int], n: int, seq_id: int = -1) -> list[int]:
        """The plain greedy loop: the target alone, one token at a time."""
        out: list[int] = []
        try:
            for _ in range(n):
                logits = self.verify(seq_id, [*prompt, *out], [])
                out.append(int(np.argmax(logits[-1])))
        finally:
            self.release(seq_id)
        return out

    def greedy_batch(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        step_times: list[float] | None = None,
    ) -> list[list[int]]:
        """The plain greedy loop for several prompts at once: one run a step for all of them
        (the seconds of each step appended to ``step_times``, the first one the prompts')."""
        ids = [-2 - i for i in range(len(prompts))]
        outs: list[list[int]] = [[] for _ in prompts]
        try:
            for _ in range(n):
                t0 = time.perf_counter()
                items = [(i, [*p, *o], ()) for i, p, o in zip(ids, prompts, outs, strict=True)]
                for out, logits in zip(outs, self.verify_batch(items), strict=True):
                    out.append(int(np.argmax(logits[-1])))
                if step_times is not None:
                    step_times.append(time.perf_counter() - t0)
        finally:
            for i in ids:
                self.release(i)
        return outs
