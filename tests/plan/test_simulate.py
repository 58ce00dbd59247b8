"""The planner's simulation against cases worked out by hand."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from exstill_sdk.plan import (
    Acceptance,
    CardProfile,
    TargetProfile,
    chain_shape,
    plan,
    simulate,
    tree_shape,
)
from exstill_sdk.plan.profiles import Curve, PassTable
from exstill_sdk.plan.shapes import DraftShape
from exstill_sdk.plan.simulate import outcomes_ahead

CARD = CardProfile(
    name="c",
    source="",
    streams=12,
    cards=1,
    draft_us_per_token=50.0,
    stream_us_per_token=0.0,
    parallel_streams=12,
    round_us=0.0,
    commit_us=0.0,
    miss_us=0.0,
    miss_stream_us=0.0,
    link_rtt_us=0.0,
    prefetch="none",
    overflow="waves",
    max_k=8,
    max_tree_nodes=64,
    max_outcomes=16,
    candidates=4,
    outcome_share=0.85,
    ahead_us_per_token=50.0,
    ahead_stream_us_per_token=0.0,
    target_slowdown=1.0,
    outcome_pass_us=None,
    outcome_us=0.0,
    tree_level_us=None,
    tree_us=0.0,
    prefetch_trees=True,
    host_us_per_round=0.0,
    host_us_per_sequence=0.0,
)
FREE = replace(CARD, draft_us_per_token=1e-9, ahead_us_per_token=1e-9)
# a memory-bound pass: flat to 8 tokens, then 1 ms a token
MEMORY_BOUND = TargetProfile(
    "t", "", None, PassTable(((0, Curve((1.0, 8.0, 64.0), (10.0, 10.0, 66.0))),))
)
ALWAYS = Acceptance("all", (1.0,) * 8)
HALF = Acceptance("half", tuple(0.5**i for i in range(1, 9)))


def test_k0_is_plain_decoding() -> None:
    p = simulate(MEMORY_BOUND, CARD, HALF, 4, 0)
    assert p.speedup == pytest.approx(1.0) and p.k == 0 and p.mean_acceptance_length == 1.0


def test_every_draft_accepted_with_a_free_card() -> None:
    """K + 1 tokens a pass that costs a plain step: exactly (K + 1)x."""
    p = simulate(MEMORY_BOUND, FREE, ALWAYS, 1, 7)
    assert p.mean_acceptance_length == 8
    assert p.speedup == pytest.approx(8.0, rel=1e-6)


def test_rate_is_acceptance_over_round_time() -> None:
    """Without prefetch every round waits for the card to take the round and each stream's
    COMMIT, the fixed cost of drafting anew (more for the second stream that missed) and K + 1
    steps of drafting (the bonus taken in, one a drafted token, the last the guess of the next
    bonus), plus the link and the host."""
    card = replace(
        CARD, link_rtt_us=200.0, host_us_per_round=100.0, round_us=40.0, commit_us=30.0,
        miss_us=50.0, miss_stream_us=20.0,
    )  # fmt: skip
    p = simulate(MEMORY_BOUND, card, HALF, 2, 3, rounds=20000)
    card_ms = 0.04 + 2 * 0.03 + 0.05 + 0.02 + 4 * 0.05
    expected = 2 * HALF.mean_length(3) / (10.0 + 0.1 + 0.2 + card_ms) * 1e3
    assert p.tokens_per_s == pytest.approx(expected, rel=0.02)
    assert p.round_ms.card == pytest.approx(card_ms)
    # a round whose drafts were made ahead: the round and the COMMITs alone
    hit = simulate(MEMORY_BOUND, replace(card, prefetch="full-acceptance"), ALWAYS, 2, 3)
    assert hit.prefetch_hit_rate == 1.0 and hit.round_ms.card == pytest.approx(0.04 + 2 * 0.03)


def test_prefetch_hides_drafting_when_it_hits() -> None:
    ahead = replace(CARD, prefetch="full-acceptance")
    hit, miss = (
        simulate(MEMORY_BOUND, ahead, ALWAYS, 1, 4),
        simulate(MEMORY_BOUND, CARD, ALWAYS, 1, 4),
    )
    assert hit.prefetch_hit_rate == 1.0 and miss.prefetch_hit_rate == 0.0
    assert hit.round_ms.card == 0.0 and miss.round_ms.card == pytest.approx(5 * 0.05)
    assert hit.tokens_per_s > miss.tokens_per_s


def test_prefetch_not_done_when_the_pass_is_shorter_than_drafting_ahead() -> None:
    slow = replace(CARD, prefetch="full-acceptance", ahead_us_per_token=4000.0)
    p = simulate(MEMORY_BOUND, slow, ALWAYS, 1, 4)  # 5 steps of 4 ms ahead, a 10 ms pass
    assert p.round_ms.card == pytest.approx(20.0 - 10.0, rel=0.01)
    # drafting ahead beside the target at 6 ms a step: 30 ms ahead, the card 20 ms late
    slower = simulate(MEMORY_BOUND, replace(slow, ahead_us_per_token=6000.0), ALWAYS, 1, 4)
    assert slower.round_ms.card == pytest.approx(30.0 - 10.0, rel=0.01)


def test_a_tree_s_pass_costs_tree_pass_times_a_chain_s() -> None:
    """A tree of 7 every round, every first choice accepted, with a free card: 7 kept and the
    bonus from a pass of 8 tokens (10 ms), at ``tree_pass`` times that; a chain is as before."""
    every = replace(ALWAYS, rank_share=(0.5,))
    shape = tree_shape(every, 7)
    slower = replace(MEMORY_BOUND, tree_pass=1.25)
    assert shape.mean_length == pytest.approx(8.0)
    assert simulate(slower, FREE, every, 1, shape).tokens_per_s == pytest.approx(
        8 / 12.5e-3, rel=1e-6
    )
    assert simulate(slower, FREE, every, 1, 7).tokens_per_s == pytest.approx(8 / 10e-3, rel=1e-6)


def test_a_card_drafting_beside_the_target_slows_its_passes() -> None:
    """The emulator shares the CPU with the target: a pass of a round it drafts for, ahead
    beside the pass or just before it (no prefetch), takes ``target_slowdown`` times as long;
    a plain step (the card idle) does not."""
    for prefetch in ("full-acceptance", "none"):
        card = replace(FREE, prefetch=prefetch)
        shared = replace(card, target_slowdown=1.25)
        slowed = simulate(MEMORY_BOUND, shared, ALWAYS, 1, 4)
        assert slowed.tokens_per_s == pytest.approx(
            simulate(MEMORY_BOUND, card, ALWAYS, 1, 4).tokens_per_s / 1.25, rel=1e-6
        )
        assert slowed.round_ms.step + slowed.round_ms.verify_extra == pytest.approx(
            MEMORY_BOUND.verify_ms(1, 5) * 1.25
        )
    shared = replace(FREE, target_slowdown=1.25)
    assert simulate(MEMORY_BOUND, shared, ALWAYS, 1, 0).tokens_per_s == pytest.approx(
        simulate(MEMORY_BOUND, FREE, ALWAYS, 1, 0).tokens_per_s
    )


def test_drafting_cost_by_streams_and_waves() -> None:
    cpu = replace(CARD, stream_us_per_token=10.0)
    assert cpu.draft_us(1, 4) == 4 * 50
    assert cpu.draft_us(12, 4) == 4 * (50 + 11 * 10)  # one batched step for all twelve
    assert replace(cpu, parallel_streams=6).draft_us(12, 4) == 4 * (2 * 50 + 10 * 10)
    assert CARD.draft_us(16, 3) == 2 * 3 * 50  # silicon: sixteen streams are two waves


def test_outcomes_prefetch_hits_the_likeliest_outcomes_that_fit() -> None:
    """A chain of 2 at a = 0.5 with the draft's second choice catching every refusal: the
    outcomes are (2 accepted, its first choice) 1/8, (0, second) 1/2, (1, second) 1/4, (2,
    second) 1/8. Drafting ahead for m outcomes of 3 steps costs 3 * 50 us a wave of 12 rows,
    and fills at most 85% of the window: one stream's four fit in one wave; twelve streams'
    m outcomes take m waves, 150 us each."""
    acceptance = replace(HALF, rank_share=(1.0,))
    chain = chain_shape(acceptance, 2)
    named = chain.named(4)
    assert list(chain.chance[named]) == pytest.approx([1 / 8, 1 / 2, 1 / 4, 1 / 8])
    card = replace(CARD, prefetch="outcomes")
    assert outcomes_ahead(card, chain, 1, window_ms=1.0) == [4]
    assert outcomes_ahead(card, chain, 12, window_ms=0.5) == [2] * 12  # 300 us of 425
    assert outcomes_ahead(card, chain, 12, window_ms=0.2) == [1] * 12  # full acceptance: always
    assert outcomes_ahead(replace(card, max_outcomes=2), chain, 1, window_ms=1.0) == [2]
    assert outcomes_ahead(replace(card, prefetch="none"), chain, 1, window_ms=1.0) == [0]
    p = simulate(MEMORY_BOUND, card, acceptance, 1, chain, rounds=20000)
    assert p.outcomes_ahead == 4 and p.prefetch_hit_rate == pytest.approx(1.0)
    full = simulate(MEMORY_BOUND, replace(card, prefetch="full-acceptance"), acceptance, 1, chain)
    assert full.prefetch_hit_rate == pytest.approx(1 / 8, abs=0.01)
    assert p.round_ms.card == 0.0 and full.round_ms.card > 0


def test_the_card_drafts_ahead_only_for_bonuses_among_its_candidates() -> None:
    """A chain of 1 at a = 0.5, the draft's second, third and fourth choices catching 1/2,
    1/4 and 1/4 of refusals: with every outcome's bonus named (3 candidates) every round hits;
    with the draft's second choice alone besides its first (1 candidate), the outcomes of
    full acceptance (1/4) and of a refusal caught by the second choice (1/4 at the first
    position, 1/8 at the second), 5/8 of rounds."""
    acceptance = replace(HALF, rank_share=(0.5, 0.25, 0.25))
    chain = chain_shape(acceptance, 1)
    assert list(chain.bonus_rank[chain.named(1)]) == [0, 1, 1]
    card = replace(CARD, prefetch="outcomes")
    for candidates, hit_rate in ((3, 1.0), (1, 5 / 8)):
        each = replace(card, candidates=candidates)
        p = simulate(MEMORY_BOUND, each, acceptance, 1, chain, rounds=20000)
        assert p.outcomes_ahead == len(chain.named(candidates))
        assert p.prefetch_hit_rate == pytest.approx(hit_rate, abs=0.01)


def test_a_card_that_drafts_each_stream_s_other_outcomes_in_a_tree_of_its_own() -> None:
    """The card runtime's way (``outcome_pass_us``): full acceptance drafted ahead for every
    stream in one batch (a chain of 2: 3 steps of 50 us), then each stream's other outcomes
    in a tree of its own, 3 passes of 100 us and 10 us an outcome. In a window of 1 ms (850
    us to fill, 700 left) four streams' first other outcomes (330 us each) fit for two of
    them, and the 40 us left a second (30 us) for one; one stream alone takes all three
    others it can name (330 + 30 + 30 us)."""
    acceptance = replace(HALF, rank_share=(1.0,))
    chain = chain_shape(acceptance, 2)
    card = replace(CARD, prefetch="outcomes", outcome_pass_us=100.0, outcome_us=10.0)
    assert outcomes_ahead(card, chain, 4, window_ms=1.0) == [3, 2, 1, 1]
    assert outcomes_ahead(card, chain, 1, window_ms=1.0) == [4]
    assert card.ahead_us(chain, [3, 2, 1, 1]) == pytest.approx(150 + 3 * (120 + 110))
    assert card.ahead_us(chain, [1, 0]) == pytest.approx(150)
    # each stream hits on its own outcomes: full acceptance 1/8, then 1/2, 1/4 and 1/8 more
    flat = TargetProfile("t", "", None, PassTable(((0, Curve((1.0, 64.0), (1.0, 1.0))),)))
    p = simulate(flat, card, acceptance, 4, chain, rounds=20000)  # a pass of 1 ms: the window
    assert p.outcomes_ahead == pytest.approx(7 / 4)
    expected = (7 / 8 + 5 / 8 + 1 / 8 + 1 / 8) / 4
    assert p.prefetch_hit_rate == pytest.approx(expected, abs=0.01)


def test_tree_rounds_verify_every_node_and_draft_by_depth() -> None:
    """A tree of N nodes verifies N + 1 tokens a sequence and drafts level by level: a level
    of w nodes for s streams is s * w rows, a wave per 12."""
    acceptance = replace(HALF, rank_share=(0.6, 0.4))
    tree = tree_shape(acceptance, 12)
    assert sum(tree.levels) == 12 and tree.steps[0] == 1
    p = simulate(MEMORY_BOUND, CARD, acceptance, 2, tree, rounds=4000)
    assert p.round_ms.step + p.round_ms.verify_extra == pytest.approx(MEMORY_BOUND.verify_ms(2, 26))
    drafting = sum(CARD.draft_us(2 * w, 1) for w in tree.steps) / 1e3
    assert p.round_ms.card == pytest.approx(drafting)  # no prefetch: every round drafts anew
    assert p.mean_acceptance_length == pytest.approx(tree.mean_length, rel=0.02)
    three = DraftShape("tree", 3, (3,), np.array([1.0]), np.array([0]), np.array([0]))
    assert CARD.drafting_us(16, three) == (2 + 4) * 50


def test_a_card_that_grows_trees_a_pass_a_level_when_their_commit_comes() -> None:
    """With ``tree_level_us`` and no tree drafted ahead (the card runtime's way): every tree
    round drafts anew, each stream's ``tree_us`` and levels after the first one after another,
    and the pass is slowed by the drafting just before it as a chain's is; a chain on the same
    card is still drafted ahead."""
    acceptance = replace(HALF, rank_share=(0.6, 0.4))
    tree = tree_shape(acceptance, 12)
    card = replace(
        CARD, prefetch="outcomes", tree_level_us=400.0, tree_us=700.0, prefetch_trees=False,
        miss_us=300.0, target_slowdown=1.5,
    )  # fmt: skip
    p = simulate(MEMORY_BOUND, card, acceptance, 2, tree, rounds=400)
    assert p.prefetch_hit_rate == 0.0 and p.outcomes_ahead == 0
    assert p.round_ms.step + p.round_ms.verify_extra == pytest.approx(
        MEMORY_BOUND.verify_ms(2, 26) * 1.5
    )
    by_hand = 300.0 + CARD.draft_us(2, 1) + 2 * (700.0 + 400.0 * (len(tree.levels) - 1))
    assert p.round_ms.card == pytest.approx(by_hand / 1e3)
    chain = simulate(MEMORY_BOUND, card, acceptance, 2, 4, rounds=400)
    assert chain.prefetch_hit_rate > 0 and chain.round_ms.verify_extra > 0
    ahead = simulate(MEMORY_BOUND, replace(card, prefetch_trees=True), acceptance, 2, tree)
    assert ahead.prefetch_hit_rate > 0


def test_waves_and_overflow() -> None:
    waves = simulate(MEMORY_BOUND, CARD, HALF, 16, 2)
    assert (waves.waves, waves.streams_used) == (2, 12)
    alone = simulate(MEMORY_BOUND, replace(CARD, overflow="target-alone"), HALF, 16, 2)
    assert (alone.waves, alone.streams_used) == (1, 12)
    # twelve users verify 3 tokens each, the other four 1: a pass of 40 tokens, not 48
    assert alone.round_ms.step + alone.round_ms.verify_extra == pytest.approx(10 + 32)
    assert waves.round_ms.step + waves.round_ms.verify_extra == pytest.approx(10 + 40)
    two = simulate(MEMORY_BOUND, replace(CARD, cards=2), HALF, 16, 2)
    assert two.waves == 1


def test_auto_k_shrinks_as_the_pass_fills() -> None:
    """On a pass that turns bound by arithmetic at 8 tokens, K falls as users are added, to 0
    once the batch alone fills the pass."""
    ks = [plan(MEMORY_BOUND, FREE, HALF, u)[0].k for u in (1, 2, 4, 8, 16)]
    assert ks[0] >= 3 and ks == sorted(ks, reverse=True) and ks[-1] == 0
    best, tried = plan(MEMORY_BOUND, FREE, HALF, 2)
    assert best.tokens_per_s == max(tried.values())
    assert set(tried) == {f"chain of {k}" for k in range(1, 9)} | {"no draft"}


def test_trees_are_weighed_where_the_draft_s_other_choices_are_known() -> None:
    """With rank shares the planner tries trees too, and on a flat pass at one user a tree
    beats every chain: its extra nodes cost nothing and catch refusals."""
    flat = TargetProfile("t", "", None, PassTable(((0, Curve((1.0, 80.0), (10.0, 10.0))),)))
    acceptance = replace(HALF, rank_share=(0.6, 0.4))
    best, tried = plan(flat, FREE, acceptance, 1)
    assert "tree of 64" in tried and best.shape.startswith("tree")


def test_the_planner_never_imports_the_hot_path() -> None:
    folder = Path(__file__).resolve().parents[2] / "exstill_sdk" / "plan"
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("exstill_sdk"):
                assert node.module.startswith(("exstill_sdk.plan", "exstill_sdk.errors")), path
