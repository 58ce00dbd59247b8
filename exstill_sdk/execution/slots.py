"""Scoring tokens of several sequences in one onnxruntime run: the weights are read once a pass.

``SlotRunner`` runs an image's slot graph (exstill_sdk.execution.graph, ``slots=R``) over the KV
buffers of an ``OnnxDecoder`` with R rows: row b is slot b, bound once. A call feeds any of
the rows any number of tokens after their own cache position (a verification round: the
tokens not yet cached and the draft). The graph runs every slot, so a slot whose row is not
fed scores one throwaway token against a one-position scratch buffer instead (rebound only
when a row starts or stops being fed).

A runner made with ``tree=True`` runs the slot graph with each slot's own position ids and
attention bias: a feed may end in a token tree's nodes (``Feed.tree``), scored as
``TreeRunner`` scores a tree alone, beside the other rows' chains and trees.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from exstill_sdk.errors import InvalidArgumentError
from exstill_sdk.execution.graph import build_decoder
from exstill_sdk.execution.runner import OnnxDecoder, open_session
from exstill_sdk.execution.trees import tree_attention
from exstill_sdk.image.reader import CardImage


class Feed(NamedTuple):
    row: int
    tokens: np.ndarray
    """int64 tokens for the row, the first at cache position ``start``."""
    start: int
    last: int
    """Logits are wanted for the last ``last`` tokens."""
    tree: tuple[np.ndarray, np.ndarray] | None = None
    """The last tokens are a tree's nodes: (their depths, which nodes each sees [N, N]); the
    row must have a cached token (``start`` > 0). Only for a runner made with ``tree=True``."""


_THROWAWAY = (np.zeros((1, 1), np.int64), np.zeros((1, 1, 1, 1), np.float32))
"""A slot not fed: its one token's position and bias (in a tree runner)."""


class SlotRunner:
    def __init__(
        self, image: CardImage, decoder: OnnxDecoder, threads: int = 0, tree: bool = False
    ) -> None:
        self.rows = rows = decoder.keys[0].shape[0]
        self.positions = decoder.positions
        self.vocab_size = decoder.vocab_size
        self.tree = tree
        self.session = open_session(
            image, build_decoder(image, decoder.positions, rows, tree), threads
        )
        io = self.io = self.session.io_binding()
        self._layers = [
            (decoder.keys[i], decoder.values[i]) for i in range(decoder.arch.num_layers)
        ]
        kv = (1, decoder.arch.num_kv_heads, 1, decoder.arch.head_dim)
        self._scratch = [(np.zeros(kv, np.float32), np.zeros(kv, np.float32)) for _ in self._layers]
        self._on_row = [True] * rows
        for b in range(rows):
            self._bind_slot(b, on_row=False)
        # per-slot scalars, bound once: a call writes them in place
        self._start = np.zeros((rows, 1), np.int64)
        self._end = np.ones((rows, 1), np.int64)
        self._seqlens = np.zeros((rows, 1), np.int32)
        self._total = np.ones(rows, np.int32)
        for b in range(rows):
            for name, array in (
                (f"slot_start_{b}", self._start[b]),
                (f"slot_end_{b}", self._end[b]),
                (f"seqlens_k_{b}", self._seqlens[b]),
                (f"total_sequence_length_{b}", self._total[b : b + 1].reshape(())),
            ):
                io.bind_input(name, "cpu", 0, array.dtype, array.shape, array.ctypes.data)

    def _bind_slot(self, b: int, on_row: bool) -> None:
        """Slot b's KV buffers: row b of the decoder's, or (a slot not fed) a one-position
        scratch buffer, where its throwaway token costs the least and touches no row."""
        if self._on_row[b] == on_row:
            return
        io = self.io
        for i, ((keys, values), scratch) in enumerate(
            zip(self._layers, self._scratch, strict=True)
        ):
            for kind, buffer, spare in (("key", keys, scratch[0]), ("value", values, scratch[1])):
                view = buffer[b : b + 1] if on_row else spare
                for name in (f"past_{kind}_{i}_{b}", f"present_{kind}_{i}_{b}"):
                    bind = io.bind_input if name.startswith("past") else io.bind_output
                    bind(name, "cpu", 0, np.float32, view.shape, view.ctypes.data)
        self._on_row[b] = on_row

    def run(self, feeds: Sequence[Feed]) -> list[np.ndarray]:
        """Score every feed in one run; the logits [feed.last, vocab] of each, in feed order."""
        by_row = sorted(range(len(feeds)), key=lambda j: feeds[j].row)
        fed = {feeds[j].row: j for j in by_row}
        if len(fed) != len(feeds):
            raise InvalidArgumentError(
                "a row is fed twice in one pass: give each sequence one feed"
            )
        ids = np.concatenate([feeds[j].tokens for j in by_row]).astype(np.int64, copy=False)
        unslot: list[int] = []
        logit_rows: list[int] = []
        order: list[slice] = [slice(0)] * len(feeds)
        flat = laid = 0
        for b in range(self.rows):
            j = fed.get(b)
            self._bind_slot(b, j is not None)
            if j is None:  # a throwaway token (the pass's first) at the scratch buffer's start
                position, n = 0, 1
                self._start[b], self._end[b] = 0, 1
                if self.tree:
                    self._bind_attention(b, *_THROWAWAY)
            else:
                feed = feeds[j]
                position, n = feed.start, len(feed.tokens)
                if self.tree:
                    self._bind_attention(b, *self._attention(feed))
                elif feed.tree is not None:
                    raise InvalidArgumentError(
                        "a tree is scored by a SlotRunner made with tree=True"
                    )
                self._start[b], self._end[b] = flat, flat + n
                unslot.extend(range(laid, laid + n))
                order[j] = slice(len(logit_rows), len(logit_rows) + feed.last)
                logit_rows.extend(range(flat + n - feed.last, flat + n))
                flat += n
            self._seqlens[b] = position + n - 1
            self._total[b] = position + n
            laid += n
        io = self.io
        io.bind_cpu_input("input_ids", ids[None, :])
        io.bind_cpu_input("unslot", np.asarray(unslot, np.int64))
        io.bind_cpu_input("logit_rows", np.asarray(logit_rows, np.int64))
        logits = np.empty((len(logit_rows), self.vocab_size), np.float32)
        io.bind_output("logits", "cpu", 0, np.float32, logits.shape, logits.ctypes.data)
        self.session.run_with_iobinding(io)
        return [logits[s] for s in order]

    @staticmethod
    def _attention(feed: Feed) -> tuple[np.ndarray, np.ndarray]:
        """The feed's position ids [1, S] and attention bias [1, 1, S, total]."""
        n = len(feed.tokens)
        if feed.tree is None:
            positions, bias = tree_attention(feed.start, n, (), np.zeros((0, 0), bool))
        else:
            depths, visible = feed.tree
            if not feed.start:
                # onnxruntime's attention takes a run with nothing cached for a prompt and
                # applies neither position ids nor bias
                raise InvalidArgumentError("a tree is fed after at least one cached token")
            prefix = n - len(depths)
            positions, bias = tree_attention(feed.start, prefix, depths, visible)
        return positions[None, :], bias[None, None]

    def _bind_attention(self, b: int, positions: np.ndarray, bias: np.ndarray) -> None:
        self.io.bind_cpu_input(f"position_ids_{b}", positions)
        self.io.bind_cpu_input(f"attention_bias_{b}", bias)
