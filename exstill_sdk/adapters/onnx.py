"""A card image run as the *target* on the host CPU with onnxruntime (no torch needed).

The same graph the card's engine runs (exstill_sdk.execution.graph), with one KV row per
sequence. ``greedy(prompt, n)`` is the plain greedy loop, the reference a speculative decoder
must reproduce.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from exstill_sdk.errors import InvalidArgumentError
from exstill_sdk.execution.runner import OnnxDecoder
from exstill_sdk.image.reader import CardImage, open_image
from exstill_sdk.speculative.adapter import TargetAdapter
from exstill_sdk.support.tokens import CachedTokens


class OnnxTarget(TargetAdapter):
    def __init__(
        self,
        image: CardImage | str | Path,
        max_sequences: int = 1,
        positions: int = 4096,
        threads: int = 0,
    ) -> None:
        self.image = image if isinstance(image, CardImage) else open_image(image, verify=True)
        self.runner = OnnxDecoder(self.image, max_sequences, positions, threads)
        self.vocab_size = self.image.arch.vocab_size
        self.eos_token_ids = tuple(self.image.tokenizer.special_ids.get("eos", ()))
        self.tokenizer = self.image.tokenizer
        self.positions = positions
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

    def verify(self, seq_id: int, context: Sequence[int], draft: Sequence[int]) -> np.ndarray:
        row = self._row(seq_id)
        if len(context) + len(draft) > self.positions:
            raise InvalidArgumentError(
                f"{len(context) + len(draft)} tokens exceed the ONNX target's {self.positions} "
                "positions"
            )
        start, tail = self._cached[seq_id].advance(context, draft)  # O(new tokens)
        return self.runner.prefill(row, np.asarray(tail, np.int64), start, last=len(draft) + 1)

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
