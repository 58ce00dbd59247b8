"""Long context: a stream keeps drafting past its slot with constant memory, exactly as an
independent numpy implementation of the same sinks + sliding-window policy does."""

from __future__ import annotations

import struct
import tracemalloc

import numpy as np
import pytest

pytest.importorskip("torch")

from exstill_firmware.engines.base import Sampling
from exstill_firmware.engines.transformer import TransformerEngine

from exstill_sdk import InvalidArgumentError
from exstill_sdk.image import open_image

from .reference import ReferenceStream


def pack(tokens: list[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def test_streaming_window_matches_numpy_reference(model_pair) -> None:
    _, path, _ = model_pair
    image = open_image(path)
    engine = TransformerEngine(image, rows=1, positions=64, sinks=4)
    state = engine.open_state(64, Sampling(), long_context=True)
    ref = ReferenceStream(image, positions=64, sinks=4)
    rng = np.random.default_rng(0)
    for step in range(40):  # ~8 evictions
        chunk = rng.integers(3, 96, int(rng.integers(1, 12))).tolist()
        state.extend(pack(chunk))
        ref.extend(chunk)
        k = int(rng.integers(1, 6))
        got = list(struct.unpack(f"<{k}I", state.propose(k).tokens))
        assert got == ref.draft(k), f"step {step}"
        # commit a prefix of the draft plus a bonus, as rounds do
        accepted = [*got[: int(rng.integers(0, k + 1))], int(rng.integers(3, 96))]
        state.extend(pack(accepted))
        ref.extend(accepted)
    assert state.evicted > 100 and state.evicted == ref.evicted
    assert len(state.tokens) // 4 <= 64


def test_64k_tokens_through_a_4k_slot_in_constant_memory(model_pair) -> None:
    _, path, _ = model_pair
    engine = TransformerEngine(open_image(path), rows=1, positions=4096, sinks=4)
    state = engine.open_state(4096, Sampling(), long_context=True)
    rng = np.random.default_rng(1)
    buffers = [b.ctypes.data for b in engine.keys + engine.values]
    tracemalloc.start()
    sizes = []
    for _ in range(64):
        state.extend(pack(rng.integers(3, 96, 1024).tolist()))
        draft = state.propose(6)
        assert len(draft.tokens) == 24
        current, _ = tracemalloc.get_traced_memory()
        sizes.append(current)
    tracemalloc.stop()
    assert state.length == 64 * 1024 and state.evicted > 60000
    assert len(state.tokens) <= 4 * 4096 and len(state.cached) <= 4 * 4096
    assert [b.ctypes.data for b in engine.keys + engine.values] == buffers  # no new KV
    # Python-side memory after warm-up stays flat (no growth with the context)
    assert max(sizes[8:]) - min(sizes[8:]) < 2 << 20


def test_rollback_into_evicted_text_is_refused(model_pair) -> None:
    _, path, _ = model_pair
    engine = TransformerEngine(open_image(path), rows=1, positions=64, sinks=4)
    state = engine.open_state(64, Sampling(), long_context=True)
    state.extend(pack(list(range(3, 90)) * 2))
    state.propose(4)
    assert state.evicted > 0
    with pytest.raises(InvalidArgumentError, match="long-context window"):
        state.truncate(10)
    state.truncate(state.length - 3)  # within the window: fine
