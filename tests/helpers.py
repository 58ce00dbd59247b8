"""What many tests build the same way: the tiny random Llama (as a checkpoint and as a card
image) and a card runtime served on a loopback TCP port from a thread."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from exstill_firmware import CardRuntime
from exstill_firmware.emulator import TcpCardServer

from exstill_sdk.harness.synthetic import write_checkpoint
from exstill_sdk.image.pack import pack_checkpoint
from exstill_sdk.speculative import TargetAdapter


def tiny_checkpoint(directory: Path, *, vocab: int = 64, seed: int = 0, std: float = 0.3) -> Path:
    """A 1-layer, 64-wide random Llama (4 heads, 2 KV heads) saved as an HF checkpoint."""
    write_checkpoint(
        directory,
        layers=1,
        hidden=64,
        intermediate=96,
        heads=4,
        kv_heads=2,
        vocab=vocab,
        seed=seed,
        std=std,
    )
    return directory


def tiny_image(
    path: Path,
    target: str = "tiny",
    *,
    vocab: int = 64,
    seed: int = 0,
    std: float = 0.3,
    **pack: Any,
) -> Path:
    """The tiny Llama packed as a card image at ``path`` for ``target`` (its checkpoint is kept
    beside it, at ``path`` with the suffix .ckpt); ``pack`` goes to pack_checkpoint."""
    checkpoint = tiny_checkpoint(path.with_suffix(".ckpt"), vocab=vocab, seed=seed, std=std)
    pack_checkpoint(checkpoint, path, target, **pack)
    return path


@contextmanager
def served(runtime: CardRuntime, port: int = 0, poll_s: float = 0.0) -> Iterator[TcpCardServer]:
    """``runtime`` served on a loopback TCP port from a thread; stopped and shut down after."""
    server = TcpCardServer(runtime, port=port, poll_s=poll_s)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop()
        thread.join(5)
        runtime.shutdown()


class CycleTarget(TargetAdapter):
    """A deterministic target: each token is ``(previous * 7 + 3) % 64``, so a repeating prompt
    continues in a pattern that prompt lookup drafts well."""

    vocab_size = 64

    def verify(self, seq_id: int, context: Sequence[int], draft: Sequence[int]) -> np.ndarray:
        seq = [*context, *draft]
        rows = []
        for i in range(len(context) - 1, len(seq)):
            logits = np.zeros(self.vocab_size)
            logits[(seq[i] * 7 + 3) % self.vocab_size] = 5.0
            rows.append(logits)
        return np.array(rows)

    def rollback(self, seq_id: int, length: int) -> None:
        pass


def cycle_reference(prompt: list[int], n: int) -> list[int]:
    """CycleTarget's own greedy continuation of ``prompt``."""
    out, last = [], prompt[-1]
    for _ in range(n):
        last = (last * 7 + 3) % 64
        out.append(last)
    return out
