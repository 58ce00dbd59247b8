"""Replaying K policies over acceptance records: the record read from a real card replays a real
decoder's rounds exactly, and the replay's bookkeeping holds for any text."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from exstill_sdk.card import open_card
from exstill_sdk.demo import DRAFT_TARGET, demo_target, emulator_url, held_out_prompts
from exstill_sdk.errors import InvalidArgumentError
from exstill_sdk.speculative import AdaptiveK, FixedK, SpeculativeDecoder
from exstill_sdk.speculative.replay import RoundCosts, record_kept, replay

COSTS = RoundCosts(
    verify_s=tuple(0.030 + 0.001 * n for n in range(1, 10)),
    host_s=0.0003,
    card_hit_s=0.0002,
    card_token_s=0.0004,
    plain_s=0.031,
)

LARGE_TARGET = RoundCosts(
    verify_s=(
        0.0144,
        0.0186,
        0.0207,
        0.0231,
        0.0247,
        0.0259,
        0.026,
        0.0286,
        0.0273,
        0.0305,
        0.028,
        0.0352,
        0.0401,
        0.0403,
    ),
    host_s=0.00015,
    card_hit_s=0.00066,
    card_token_s=0.00015,
    plain_s=0.0155,
    prompt_s=0.113,
)
"""The large demo target's costs as ``exstill-bench policy`` measured them."""


def test_a_record_replays_the_real_decoder_round_for_round() -> None:
    """On the demo pair, what fixed K rounds keep by the record is what the decoder's rounds on
    the emulated card kept: the same rounds, the same tokens accepted at each position."""
    from exstill_sdk.adapters.onnx import OnnxTarget

    target = OnnxTarget(demo_target("small").image, positions=512, threads=1)
    prompts = held_out_prompts(2, 64)
    with open_card(emulator_url()) as card:
        for prompt in prompts:
            output = target.greedy(prompt, 64)
            kept = record_kept(card, DRAFT_TARGET, prompt, output)
            assert 0 < sum(kept) < len(kept)  # the text has both, or the check says little
            for k in (1, 3, 8):
                decoder = SpeculativeDecoder(card, target, draft=DRAFT_TARGET, k=k, max_k=8)
                real = decoder.generate(prompt, 64, stop_token_ids=[])
                assert real.tokens == output
                replayed = replay(FixedK(k), kept, COSTS, 8)
                assert replayed.rounds == real.metrics.rounds
                assert replayed.accepted == real.metrics.num_accepted_tokens


@given(st.lists(st.booleans(), min_size=1, max_size=200), st.integers(0, 8))
def test_fixed_k_replay_emits_the_text_once(kept: list[bool], k: int) -> None:
    """Every round emits its kept tokens and one more, and the text is emitted exactly: at most
    one round a token, at least one a K + 1 tokens; a text the draft takes whole at K + 1 a
    round, one it never takes at one a round."""
    run = replay(FixedK(k), kept, COSTS, 8)
    n = len(kept)
    assert run.accepted + run.rounds == n
    assert math.ceil(n / (k + 1)) <= run.rounds <= n
    assert sum(run.k_chosen.values()) == run.rounds
    assert run.seconds > 0
    assert replay(FixedK(k), [True] * n, COSTS, 8).rounds == math.ceil(n / (k + 1))
    assert replay(FixedK(k), [False] * n, COSTS, 8).rounds == n


@given(st.lists(st.booleans(), min_size=1, max_size=300))
def test_the_adaptive_policy_replays_any_text(kept: list[bool]) -> None:
    """AdaptiveK driven by the replay as the decoder drives it: every round counted, the text
    emitted exactly, no K above the limit."""
    run = replay(AdaptiveK(8), kept, COSTS, 8)
    assert run.accepted + run.rounds == len(kept)
    assert sum(run.k_chosen.values()) == run.rounds
    assert max(run.k_chosen) <= 8


def test_a_round_costs_what_the_table_says() -> None:
    """Fixed K: each round's pass, host share and card round trip; the card drafted ahead of
    every round but the first (the prompt's catch-up is not counted)."""
    kept = [True, True, False] * 10
    run = replay(FixedK(2), kept, COSTS, 8)
    assert run.rounds == 10
    per_round = COSTS.verify(3) + COSTS.host_s + COSTS.card_hit_s
    assert run.seconds == pytest.approx(10 * per_round - COSTS.host_s - COSTS.card_hit_s)


def test_bad_costs_and_texts_are_refused() -> None:
    with pytest.raises(InvalidArgumentError):
        RoundCosts(verify_s=(), host_s=0, card_hit_s=0, card_token_s=0, plain_s=1)
    with pytest.raises(InvalidArgumentError):
        replay(FixedK(2), [], COSTS, 8)
    assert COSTS.verify(12) == pytest.approx(0.030 + 0.012)  # beyond the table: its line


def test_a_text_whose_first_tokens_the_draft_misses_is_still_drafted() -> None:
    """Four misses at a text's start are the text's first four drafts, not its verdict: with
    this text's counts worth two drafts against every text's, a policy that had drafted a text
    it got every other token of went to K = 0 for 120 of the next text's 124 rounds, though
    the draft takes the rest of it whole."""
    policy = AdaptiveK(16)
    replay(policy, [True, False] * 64, LARGE_TARGET, 16)
    run = replay(policy, [False] * 4 + [True] * 124, LARGE_TARGET, 16)
    assert run.k_chosen[0] <= 2
    assert run.speedup(LARGE_TARGET) > 3.0  # K = 16 throughout: 3.5; K = 0 for good: 1.1
