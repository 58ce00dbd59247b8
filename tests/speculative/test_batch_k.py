"""K chosen for a batch: the planner against simulated pass costs, and the decoder's batched
rounds (one verification pass for every sequence, sequences beyond the card's streams running
with the target alone) against a real card runtime and a real ONNX target."""

from __future__ import annotations

import numpy as np
import pytest

from exstill_sdk import open_card
from exstill_sdk.adapters.onnx import OnnxTarget
from exstill_sdk.demo import DRAFT_TARGET, demo_dir, held_out_prompts
from exstill_sdk.speculative import SpeculativeDecoder
from exstill_sdk.speculative.batch_k import BatchK, PassCost
from exstill_sdk.speculative.timing import PassTiming


def test_the_pass_cost_follows_what_was_measured() -> None:
    cost = PassCost()
    assert cost(10) == 10 * cost(1)  # nothing measured: as if every token cost the same
    cost.observe(4, 0.050)
    assert cost(8) == pytest.approx(0.100)  # one size: still proportional
    for tokens, seconds in ((8, 0.060), (12, 0.058), (16, 0.080), (16, 0.082)):
        cost.observe(tokens, seconds)
    # more tokens never cost less: the noisy 12 is pooled with 8, as one point at 10
    assert cost(10) == pytest.approx(0.059)
    assert cost(7) == pytest.approx(0.050 + 0.009 / 2)  # joined by lines
    assert cost(4) < cost(8) < cost(12) < cost(16) == pytest.approx(0.081)
    assert cost(32) > cost(16) + 16 * 0.001  # beyond: the slope of all of them


def simulate(
    users: int, passes: int, *, fixed_ms: float, per_token_ms: float, a: float
) -> list[int]:
    """Total drafted tokens per pass over ``passes`` passes of ``users`` sequences, a pass of
    T tokens costing fixed_ms + per_token_ms * T, each position accepted with probability a."""
    rng = np.random.default_rng(0)
    planner = BatchK(max_k=8)
    seqs = list(range(users))
    drafted = []
    for _ in range(passes):
        ks = planner.choose(seqs, [8] * users)
        drafted.append(sum(ks))
        for seq, k in zip(seqs, ks, strict=True):
            accepted = 0
            while accepted < k and rng.random() < a:
                accepted += 1
            planner.observe_round(seq, k, accepted)
        tokens = users + sum(ks)
        seconds = (fixed_ms + per_token_ms * tokens) * 1e-3 * rng.uniform(0.97, 1.03)
        planner.observe_pass(PassTiming(tokens, seconds, 1e-3, 0.0, sum(ks), steady=True))
    return drafted


def test_a_pass_bound_by_memory_drafts_long() -> None:
    drafted = simulate(4, 200, fixed_ms=50, per_token_ms=0.5, a=0.85)
    assert np.median(drafted[-100:]) >= 4 * 5


def test_a_pass_bound_by_arithmetic_drafts_nothing() -> None:
    # a pass costs about its tokens: drafting a token that is emitted 60% of the time loses
    drafted = simulate(8, 200, fixed_ms=2, per_token_ms=10, a=0.6)
    assert np.median(drafted[-100:]) == 0


def test_between_them_a_few_tokens_each() -> None:
    drafted = simulate(8, 200, fixed_ms=40, per_token_ms=3.5, a=0.8)
    assert 8 <= np.median(drafted[-100:]) <= 8 * 4


def test_a_sequence_taken_whole_is_expected_to_go_on_past_what_it_drafted() -> None:
    """Positions a sequence has not reached take its own rate above them, not only what other
    sequences' texts showed there: one sequence kept all 4 of its drafts every round while
    another always lost its 5th, and the first is still expected to keep a 5th."""
    planner = BatchK(max_k=8)
    for _ in range(10):
        planner.observe_round(0, 4, 4)
        planner.observe_round(1, 8, 4)
    whole, halted = planner.acceptance(0), planner.acceptance(1)
    assert whole[:4] == pytest.approx(halted[:4], abs=0.05) and min(whole[:4]) > 0.9
    assert halted[4] < 0.3  # its own ten rejections at the 5th
    assert whole[4] > 0.8  # before: the others' rate there, below 0.2


def test_many_users_on_a_small_card_are_exact_and_do_not_hammer_it() -> None:
    """Ten users on a 3-stream card: the seven without a stream run with the target alone and
    ask again only when a stream frees; every output is the target's own greedy output."""
    prompts = held_out_prompts(10, 24)
    target = OnnxTarget(demo_dir() / "target.img", max_sequences=10, positions=256)
    reference = target.greedy_batch(prompts, 40)
    url = f"emu://?image={demo_dir() / 'draft.img'}&context=256&streams=3"
    with open_card(url) as card:
        decoder = SpeculativeDecoder(card, target, draft=DRAFT_TARGET)
        results = decoder.generate_batch(prompts, 40, stop_token_ids=[])
        stats = card.stats()
    assert [r.tokens for r in results] == reference
    assert decoder.metrics.num_drafts > 0
    assert stats["streams_opened"] >= 3
    # a refusal per waiting user at the start, then at most one per stream freed
    assert stats["errors.card_full"] <= 7 + stats["streams_opened"]
