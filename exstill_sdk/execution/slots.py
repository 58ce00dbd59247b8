"""Scoring tokens of several sequences in one onnxruntime run: the weights are read once a pass.

``SlotRunner`` runs an image's slot graph (exstill_sdk.execution.graph, ``slots=R``) over the KV
buffers of an ``OnnxDecoder`` with R rows: row b is slot b, bound once. A call feeds any of
the rows any number of tokens after their own cache position (a verification round: the
tokens not yet cached and the draft). The graph runs every slot, so a slot whose row is not
fed scores one throwaway token against a one-position scratch buffer instead (rebound only
when a row starts or stops being fed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from exstill_sdk.errors import InvalidArgumentError
from exstill_sdk.execution.graph import build_decoder
from exstill_sdk.execution.runner import OnnxDecoder, open_session
from exstill_sdk.image.reader import CardImage


class Feed(NamedTuple):
    row: int
    tokens: np.ndarray
    """int64 tokens for the row, the first at cache position ``start``."""
    start: int
    last: int
    """Logits are wanted for the last ``last`` tokens."""


class SlotRunner:
    def __init__(self, image: CardImage, decoder: OnnxDecoder, threads: int = 0) -> None:
        self.rows = rows = decoder.keys[0].shape[0]
        self.positions = decoder.positions
        self.vocab_size = decoder.vocab_size
        self.session = open_session(image, build_decoder(image, decoder.positions, rows), threads)
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
            else:
                feed = feeds[j]
                position, n = feed.start, len(feed.tokens)
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
