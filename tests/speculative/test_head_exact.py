"""A draft with a frequency-ranked head never proposes a token outside it, and speculative
decoding with it keeps the target's output: greedy token for token, sampled in distribution
(chi-square), through the emulator."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from exstill_firmware.engines.base import Sampling
from exstill_firmware.engines.transformer import TransformerEngine

from exstill_sdk import WireMode, open_card
from exstill_sdk.adapters.onnx import OnnxTarget
from exstill_sdk.image import open_image
from exstill_sdk.image.pack import pack_checkpoint
from exstill_sdk.speculative import SamplingParams, SpeculativeDecoder

from ..helpers import tiny_image
from .test_sampled_e2e import PROMPT, VOCAB, chi_square_ok, first_two, first_two_laws

HEAD = [9, 3, 14, 0, 7, 12, 5]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The target, and the target itself as a draft with a head of 7 of its 16 tokens: its
    drafts are right exactly when the target's token is in the head."""
    root = tmp_path_factory.mktemp("head")
    target = tiny_image(root / "target.img", "target", vocab=VOCAB, seed=1, std=0.25)
    draft = root / "draft.img"
    pack_checkpoint(target.with_suffix(".ckpt"), draft, "draft", head_ids=HEAD)
    return target, draft


def test_the_engine_drafts_only_head_tokens(pair) -> None:
    engine = TransformerEngine(open_image(pair[1]), rows=2, positions=64)
    rng = np.random.default_rng(3)
    drafted = set()
    for sampling in (Sampling(), Sampling(temperature=1.5, seed=4)):
        state = engine.open_state(64, sampling)
        for _ in range(20):
            context = rng.integers(0, VOCAB, 5).tolist()
            state.truncate(0)
            state.extend(struct.pack("<5I", *context))
            proposal = state.propose(6)
            drafted.update(struct.unpack(f"<{len(proposal.tokens) // 4}I", proposal.tokens))
            for dist in proposal.dists or ():
                assert set(dist.tokens) <= set(HEAD)
        state.close()
    assert drafted and drafted <= set(HEAD)


def test_greedy_output_is_the_targets(pair) -> None:
    target_img, draft_img = pair
    target = OnnxTarget(target_img, max_sequences=8, positions=96)
    prompts = [[i % VOCAB, (5 * i + 1) % VOCAB, 2] for i in range(8)]
    want = [OnnxTarget(target_img, positions=96).greedy(p, 40) for p in prompts]
    with open_card(f"emu://?image={draft_img}&context=96") as card:
        decoder = SpeculativeDecoder(card, target, draft="draft", k=4)
        got = decoder.generate_batch(prompts, 40, stop_token_ids=[])
    assert [r.tokens for r in got] == want
    assert decoder.metrics.num_accepted_tokens > 0
    outside = sum(t not in HEAD for r in want for t in r)
    assert outside > 0  # the target wrote tokens the draft cannot propose, and they are kept


@pytest.mark.parametrize("mode", [WireMode.DIST, WireMode.TOKENS])
def test_sampled_output_has_the_targets_distribution(pair, mode: WireMode) -> None:
    target_img, draft_img = pair
    params = SamplingParams(temperature=1.0, seed=23)
    target = OnnxTarget(target_img, max_sequences=12, positions=64)
    with open_card(f"emu://?image={draft_img}&context=64") as card:
        decoder = SpeculativeDecoder(
            card, target, draft="draft", sampling=params, k=3, wire_mode=mode
        )
        results = decoder.generate_batch([PROMPT] * 3000, 2, stop_token_ids=[])
    assert decoder.metrics.num_accepted_tokens > 0
    first, second = first_two(results)
    p1, p2 = first_two_laws(target, params)
    assert p1[np.setdiff1d(np.arange(VOCAB), HEAD)].sum() > 0.05  # tokens no draft proposes
    # four checks in this file, each at 0.01 / 4 (Bonferroni)
    assert chi_square_ok(first, p1) > 0.0025
    assert chi_square_ok(second, p2) > 0.0025
