"""Batched verification in the ONNX target: one onnxruntime run for every sequence of a round
gives what verifying them one by one gives (issue: many users)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from exstill_sdk.adapters.onnx import OnnxTarget
from exstill_sdk.demo import demo_dir, held_out_prompts
from exstill_sdk.execution.runner import MAX_CHUNK
from tests.helpers import tiny_image


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_image(tmp_path_factory.mktemp("batch") / "tiny.img")


def _rounds(image: Path, vocab: int, positions: int) -> None:
    """Three rounds of five sequences: different context lengths, different K (one at K = 0,
    one with a new context longer than a chunk), each round after a partial acceptance."""
    rng = np.random.default_rng(1)
    batched = OnnxTarget(image, max_sequences=6, positions=positions)
    single = OnnxTarget(image, max_sequences=6, positions=positions)
    contexts = {
        seq: list(rng.integers(0, vocab, n))
        for seq, n in ((10, 3), (11, 40), (12, 1), (13, MAX_CHUNK + 30), (14, 17))
    }
    for _ in range(3):
        drafts = {
            seq: list(rng.integers(0, vocab, k))
            for seq, k in zip(contexts, (4, 0, 7, 2, 1), strict=True)
        }
        items = [(seq, contexts[seq], drafts[seq]) for seq in contexts]
        got = batched.verify_batch(items)
        for (seq, context, draft), logits in zip(items, got, strict=True):
            want = single.verify(seq, context, draft)
            assert logits.shape == (len(draft) + 1, vocab)
            assert np.abs(logits - want).max() <= 1e-4
            assert (logits.argmax(-1) == want.argmax(-1)).all()
            kept = len(context) + len(draft) // 2  # the target keeps half the draft
            for target in (batched, single):
                target.rollback(seq, kept)
            contexts[seq] = [
                *context,
                *draft[: len(draft) // 2],
                int(want[len(draft) // 2].argmax()),
            ]


def test_batched_verification_matches_one_by_one_on_the_tiny_target(tiny: Path) -> None:
    _rounds(tiny, 64, 512)


def test_batched_verification_matches_one_by_one_on_the_demo_target() -> None:
    _rounds(demo_dir() / "target.img", 4096, 512)


def test_a_sequence_left_out_of_a_batch_keeps_its_cache(tiny: Path) -> None:
    target = OnnxTarget(tiny, max_sequences=3, positions=128)
    reference = OnnxTarget(tiny, max_sequences=3, positions=128)
    idle = [5, 6, 7, 8, 9]
    for t in (target, reference):
        t.verify(0, idle, [])
    target.verify_batch([(1, [1, 2, 3], [4, 5]), (2, [7], [])])
    got, want = target.verify(0, [*idle, 10], [11]), reference.verify(0, [*idle, 10], [11])
    assert np.abs(got - want).max() <= 1e-4


def test_the_plain_batch_baseline_is_the_plain_loop() -> None:
    prompts = held_out_prompts(3, 24)
    target = OnnxTarget(demo_dir() / "target.img", max_sequences=4, positions=256)
    batch = target.greedy_batch([*prompts, prompts[0][:7]], 20)
    assert batch == [target.greedy(p, 20) for p in [*prompts, prompts[0][:7]]]
