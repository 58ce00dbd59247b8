"""Sampled speculative decoding through the emulator keeps the target's distribution: token
frequencies of many seeded runs against the target's exact probabilities (chi-square), in both
wire modes, with a tiny-vocabulary model (no torch needed); and with the card answering rounds
from drafts it made ahead for several verification outcomes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from exstill_firmware import CardRuntime
from exstill_firmware.engines.transformer import TransformerEngine
from scipy import stats

from exstill_sdk import WireMode, open_card
from exstill_sdk.adapters.onnx import OnnxTarget
from exstill_sdk.card import Card
from exstill_sdk.image import open_image
from exstill_sdk.protocol.messages import TreeRequest
from exstill_sdk.speculative import SamplingParams, SpeculativeDecoder, target_probs
from exstill_sdk.transport.emu import EmuTransport

from ..helpers import tiny_image

VOCAB = 16
PROMPT = [3, 7, 1, 12]


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tinyvocab")
    paths = []
    for name, seed in (("target", 1), ("draft", 2)):
        tiny_image(root / f"{name}.img", name, vocab=VOCAB, seed=seed, std=0.25)
        paths.append(root / f"{name}.img")
    return paths[0], paths[1]


def chi_square_ok(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of counts against probs, pooling cells expected below 5."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    assert counts[probs == 0].sum() == 0
    return float(stats.chisquare(obs[keep], exp[keep] * obs.sum() / exp[keep].sum()).pvalue)


class DraftingAhead(OnnxTarget):
    """A target whose every verification first lets the card (a runtime serving as a link
    does, between requests) draft ahead, as a card does while the host verifies; the host
    is taken to verify slowly enough for every outcome the card plans."""

    def __init__(self, runtime: CardRuntime, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.runtime = runtime

    def _card_works(self) -> None:
        for stream in self.runtime.streams.by_handle.values():
            stream.window = 60.0
        self.runtime.run_prefetch()

    def verify(self, seq_id, context, draft):
        self._card_works()
        return super().verify(seq_id, context, draft)

    def verify_batch(self, items):
        self._card_works()
        return super().verify_batch(items)


def sampled_results(card, target, mode: WireMode, params: SamplingParams, n: int) -> list:
    decoder = SpeculativeDecoder(card, target, draft="draft", sampling=params, k=3, wire_mode=mode)
    # four tokens, so that the second is often decided by a round drafted after a COMMIT
    results = decoder.generate_batch([PROMPT] * n, 4, stop_token_ids=[])
    assert decoder.metrics.num_accepted_tokens > 0  # the draft is sometimes right
    return results


@pytest.mark.parametrize("ahead", ["none", "outcomes"])
@pytest.mark.parametrize("mode", [WireMode.DIST, WireMode.TOKENS])
def test_token_frequencies_match_the_target(images, mode: WireMode, ahead: str) -> None:
    target_img, draft_img = images
    params = SamplingParams(temperature=1.0, seed=11)
    n = 4000
    if ahead == "none":
        target = OnnxTarget(target_img, max_sequences=12, positions=64)
        with open_card(f"emu://?image={draft_img}&context=64") as card:
            results = sampled_results(card, target, mode, params, n)
    else:
        engine = TransformerEngine(open_image(draft_img), rows=12, positions=64)
        runtime = CardRuntime(12, 64, [engine], background_prefetch=False)
        target = DraftingAhead(runtime, target_img, max_sequences=12, positions=64)
        with Card(EmuTransport(runtime, owns_runtime=True)) as card:
            results = sampled_results(card, target, mode, params, n)
            hits = card.stats()["prefetch_outcome_hits"]
        assert hits >= n // 40  # rounds answered from drafts made ahead for other outcomes
    first, second = first_two(results)
    p1, p2 = first_two_laws(target, params)
    # ten goodness-of-fit checks in this file (2 modes x 2 ways x 2 positions, and the sampled
    # trees' 2): each at 0.01 / 10, a family-wise false-alarm rate of 1% (Bonferroni)
    assert chi_square_ok(first, p1) > 0.001
    assert chi_square_ok(second, p2) > 0.001


def first_two(results: list) -> tuple[np.ndarray, np.ndarray]:
    """How often each token came first, and second, in the results."""
    first = np.bincount([r.tokens[0] for r in results], minlength=VOCAB)
    second = np.bincount([r.tokens[1] for r in results], minlength=VOCAB)
    return first, second


def first_two_laws(target: OnnxTarget, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The target's exact laws of its first token after PROMPT, p(t1 | prompt), and of its
    second (the marginal over t1)."""
    p1 = target_probs(target.verify(-1, PROMPT, [])[-1:], params)[0]
    p2 = np.zeros(VOCAB)
    for t1 in np.flatnonzero(p1):
        p2 += p1[t1] * target_probs(target.verify(-1, [*PROMPT, int(t1)], [])[-1:], params)[0]
    target.release(-1)
    return p1, p2


def test_sampled_trees_keep_the_targets_distribution(images) -> None:
    """The card draws each tree node's children from its distribution without replacement
    and sends the distributions; the host verifies by recursive rejection sampling over the
    siblings. Every round from the first is a tree of 6 nodes, up to 3 children a node, 2 deep
    (the three tokens asked: two drafted, one the target's)."""
    target_img, draft_img = images
    params = SamplingParams(temperature=1.0, seed=29)
    target = OnnxTarget(target_img, max_sequences=12, positions=64)
    with open_card(f"emu://?image={draft_img}&context=64") as card:
        decoder = SpeculativeDecoder(
            card, target, draft="draft", sampling=params, k=3, trees=TreeRequest(6, 3, 2)
        )
        results = decoder.generate_batch([PROMPT] * 3000, 3, stop_token_ids=[])
    assert decoder.tree_note == ""
    metrics = decoder.metrics
    # each sequence's first round is a tree; after it, what room is left takes a chain
    assert metrics.tree_rounds == 3000
    assert metrics.num_accepted_tokens > 0
    first, second = first_two(results)
    p1, p2 = first_two_laws(target, params)
    assert chi_square_ok(first, p1) > 0.001
    assert chi_square_ok(second, p2) > 0.001


def test_seeded_runs_are_reproducible(images) -> None:
    target_img, draft_img = images
    outputs = []
    for _ in range(2):
        target = OnnxTarget(target_img, max_sequences=4, positions=64)
        with open_card(f"emu://?image={draft_img}&context=64") as card:
            decoder = SpeculativeDecoder(
                card, target, draft="draft", k=3, sampling=SamplingParams(temperature=0.9, seed=77)
            )
            outputs.append([r.tokens for r in decoder.generate_batch([PROMPT] * 4, 12, [])])
    assert outputs[0] == outputs[1]
    assert len({tuple(t) for t in outputs[0]}) > 1  # different sequences, different draws


def test_sixteen_users_on_twelve_streams(images) -> None:
    """More sequences than streams wait in a queue and run as streams free up."""
    target_img, draft_img = images
    target = OnnxTarget(target_img, max_sequences=12, positions=64)
    prompts = [[i % VOCAB, (3 * i) % VOCAB, 5] for i in range(16)]
    reference = [OnnxTarget(target_img, positions=64).greedy(p, 10) for p in prompts]
    with open_card(f"emu://?image={draft_img}&context=64&streams=12") as card:
        decoder = SpeculativeDecoder(card, target, draft="draft", k=3)
        results = decoder.generate_batch(prompts, 10, stop_token_ids=[])
        stats_ = card.stats()
    assert [r.tokens for r in results] == reference
    assert stats_["streams_opened"] == 16 and stats_["streams_open"] == 0
