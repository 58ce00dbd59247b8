"""Adaptive K down to K = 0: the policy against simulated costs, and the decoder's rounds of the
target alone (no card round, the card brought up to date when drafting resumes) against a real
card runtime and a real ONNX target."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from exstill_sdk import open_card
from exstill_sdk.adapters.onnx import OnnxTarget
from exstill_sdk.demo import DRAFT_TARGET, demo_dir, demo_tokenizer, emulator_url
from exstill_sdk.speculative import AdaptiveK, KPolicy, SpeculativeDecoder
from exstill_sdk.speculative.rounds import PolicyPlanner


def simulate(
    policy: AdaptiveK,
    rounds: int,
    *,
    acceptance: float,
    step_ms: float,
    per_token_ms: float,
    card_ms_per_token: float,
    seed: int = 0,
    stall_ms: dict[int, float] | None = None,
) -> list[int]:
    """The K chosen over ``rounds`` rounds of a target whose verify of n tokens costs
    step_ms + per_token_ms * (n - 1), with a card drafting at card_ms_per_token, each drafted
    position accepted with probability ``acceptance`` given the ones before it; ``stall_ms``:
    the card's wait in the rounds named instead (a stall)."""
    rng = np.random.default_rng(seed)
    chosen = []
    k = policy.choose(8)
    for _ in range(rounds):
        chosen.append(k)
        accepted = 0
        while accepted < k and rng.random() < acceptance:
            accepted += 1
        verify = (step_ms + per_token_ms * k) * 1e-3 * rng.uniform(0.95, 1.05)
        policy.observe_acceptance(k, accepted)  # as the decoder tells it: before the next K
        next_k = policy.choose(8)
        wait = (stall_ms or {}).get(len(chosen) - 1, card_ms_per_token * next_k) * 1e-3
        # as the decoder tells it: a draft after a round of the target alone came with a
        # catch-up, which is not what drafting costs
        policy.observe(k, accepted, verify, 20e-6, next_k if k else 0, wait)
        k = next_k
    return chosen


def test_k_zero_when_drafting_does_not_pay_and_probes_thin_out() -> None:
    # a target that fits in cache: each extra token costs 60% of a step; a slow card
    policy = AdaptiveK(8)
    chosen = simulate(
        policy, 600, acceptance=0.6, step_ms=0.5, per_token_ms=0.3, card_ms_per_token=0.15
    )
    late = chosen[100:]
    assert Counter(late)[0] > 0.97 * len(late)
    probes = [i for i, k in enumerate(chosen) if k and i > 60]
    gaps = np.diff(probes)
    assert len(probes) >= 2 and (gaps[1:] >= gaps[:-1]).all()  # probing backs off


def test_long_drafts_when_verification_is_cheap() -> None:
    # a target bound by memory: 9 tokens cost 1.6 steps; a card of 0.1 ms per token
    policy = AdaptiveK(8)
    chosen = simulate(
        policy, 400, acceptance=0.92, step_ms=21.0, per_token_ms=1.6, card_ms_per_token=0.1
    )
    assert np.mean(chosen[100:]) >= 5 and 0 not in chosen[100:]


def test_expected_rate_is_the_plans_best() -> None:
    """What a tree must beat (TreeChooser): the tokens a second the policy expects of rounds at
    its best K, near what the simulated costs give at the K it settles on."""
    policy = AdaptiveK(8)
    assert policy.expected_rate() is None and policy.verify_seconds(3) is None  # nothing yet
    chosen = simulate(
        policy, 400, acceptance=0.92, step_ms=21.0, per_token_ms=1.6, card_ms_per_token=0.1
    )
    rate = policy.expected_rate()
    assert rate is not None
    k = Counter(chosen[200:]).most_common(1)[0][0]
    kept = sum(0.92**j for j in range(k + 1))  # the bonus token, then each accepted position
    seconds = (21.0 + 1.6 * k + 0.1 * k) * 1e-3 + 20e-6
    assert rate == pytest.approx(kept / seconds, rel=0.15)
    # and what a pass costs, beyond the longest chain too (a tree of 15 nodes scores 16)
    assert policy.verify_seconds(9) == pytest.approx((21.0 + 1.6 * 8) * 1e-3, rel=0.05)
    assert policy.verify_seconds(16) == pytest.approx((21.0 + 1.6 * 15) * 1e-3, rel=0.1)
    assert KPolicy().expected_rate() is None and KPolicy().verify_seconds(9) is None


def test_a_new_sequence_is_a_new_text() -> None:
    """After 400 rounds of text a chain takes whole, a sequence whose text is hard: told that
    a new sequence began, the policy leaves long drafts within a few rounds; not told, its
    record of the easy text keeps it at K = 8 for the whole sequence."""
    costs = dict(step_ms=21.0, per_token_ms=1.6, card_ms_per_token=0.1)
    chosen = {}
    for told in (False, True):
        policy = AdaptiveK(8)
        simulate(policy, 400, acceptance=0.97, **costs)
        if told:
            policy.start_sequence()
        chosen[told] = simulate(policy, 40, acceptance=0.3, seed=1, **costs)
    assert np.mean(chosen[True][10:]) <= 2 and np.mean(chosen[False][10:]) >= 6


def test_a_text_taken_whole_gets_long_drafts_at_once() -> None:
    """After 400 rounds of text the draft mostly misses (K settles short), a sequence whose
    text the draft takes whole: from the fifth round on the policy drafts the longest chain, as
    what this text shows outweighs what other texts showed of positions it has not reached
    (every text's rate weighs as four of this text's drafts; at two: from the fourth round)."""
    costs = dict(step_ms=21.0, per_token_ms=1.6, card_ms_per_token=0.1)
    policy = AdaptiveK(8)
    before = simulate(policy, 400, acceptance=0.5, **costs)
    assert np.mean(before[100:]) <= 4
    policy.start_sequence()
    chosen = simulate(policy, 12, acceptance=1.0, seed=1, **costs)
    assert min(chosen[4:]) == 8


def test_rounds_of_the_target_alone_do_not_replan_every_round() -> None:
    """At K = 0 the policy plans again only every IDLE_REPLAN_EVERY rounds (a plan costs
    microseconds, as much as a small target's step costs the host) or after a probe's verdict:
    a round of the target alone tells no acceptance, so it is no verdict to plan on."""
    costs = dict(step_ms=0.5, per_token_ms=0.3, card_ms_per_token=0.15)
    policy = AdaptiveK(8)
    simulate(policy, 200, acceptance=0.6, **costs)
    plans = 0
    plan = policy._plan

    def counted() -> int:
        nonlocal plans
        plans += 1
        return plan()

    policy._plan = counted  # type: ignore[method-assign]
    chosen = simulate(policy, 320, acceptance=0.6, seed=1, **costs)
    probes = sum(1 for k in chosen if k)
    assert Counter(chosen)[0] > 0.9 * len(chosen)
    assert plans <= len(chosen) // AdaptiveK.IDLE_REPLAN_EVERY + 2 * probes + 2


def test_verdicts_told_alone_move_the_plan() -> None:
    """Tree rounds tell the policy only what the chain inside each kept (no round costs, so
    its round count stands still): the chain's expected rate, what a tree must beat, follows
    them at once. Without replanning on a verdict it stayed where the last chain round left it
    for as long as trees ran."""
    costs = dict(step_ms=21.0, per_token_ms=1.6, card_ms_per_token=0.1)
    policy = AdaptiveK(8)
    simulate(policy, 200, acceptance=0.5, **costs)
    policy.start_sequence()
    simulate(policy, 20, acceptance=0.5, seed=1, **costs)
    before, rounds = policy.expected_rate(), policy.rounds
    assert before is not None
    for _ in range(12):  # tree rounds whose chain was taken whole
        policy.observe_acceptance(8, 8)
        policy.choose(8)
    after = policy.expected_rate()
    assert policy.rounds == rounds and after is not None and after > 1.5 * before
    assert policy.choose(8) >= 7


def test_the_planner_tells_acceptance_before_the_next_k() -> None:
    """The decoder's planner tells the policy a round's acceptance as soon as the verdict is
    known, so the K chosen next already knows it (what the round cost follows a round later)."""
    told: list[tuple[str, int]] = []

    class Recording(KPolicy):
        def observe_acceptance(self, k: int, accepted: int) -> None:
            told.append(("acceptance", accepted))

        def choose(self, max_k: int) -> int:
            told.append(("choose", max_k))
            return 3

    planner = PolicyPlanner(Recording())
    planner.observe_round(0, 3, 2)
    assert planner.choose([0], [5]) == [3]
    assert told == [("acceptance", 2), ("choose", 5)]


def test_drafting_resumes_when_it_pays_again() -> None:
    # the same costs throughout; the text turns from hard to draft to easy
    costs = dict(step_ms=0.5, per_token_ms=0.1, card_ms_per_token=0.05)
    policy = AdaptiveK(8)
    simulate(policy, 400, acceptance=0.3, **costs)
    assert policy.choose(8) == 0
    chosen = simulate(policy, 3000, acceptance=0.97, **costs)
    assert np.mean(chosen[-200:]) >= 4


def test_one_stall_of_the_card_does_not_stop_drafting() -> None:
    """A card's one slow answer (37 ms for a draft of one token, seen on the emulated card)
    costs one round, not the sequence: the card's wait for a draft of K is the median of its
    latest waits. A moving average of waits a token that it lifted to 7.6 ms put the small
    demo target at K = 0 for good, as rounds of the target alone never tell it otherwise."""
    costs = dict(step_ms=0.5, per_token_ms=0.05, card_ms_per_token=0.02)
    policy = AdaptiveK(8)
    before = simulate(policy, 200, acceptance=0.9, **costs)
    assert 0 not in before[100:]
    policy.start_sequence()  # what rounds at each K gave is forgotten: the model decides
    after = simulate(policy, 400, acceptance=0.9, seed=1, stall_ms={0: 37.0}, **costs)
    assert Counter(after[10:])[0] < 0.05 * len(after)  # the moving average: 387 of 390


def test_a_first_round_of_the_target_alone_is_not_what_the_target_alone_costs() -> None:
    """The first round at K = 0 after drafting shares the machine with the card drafting
    ahead (on the small demo target it took three plain steps): what the target alone costs is
    read from rounds at K = 0 that follow one."""
    costs = dict(step_ms=0.5, per_token_ms=0.3, card_ms_per_token=0.15)
    policy = AdaptiveK(8)
    simulate(policy, 300, acceptance=0.6, **costs)
    assert policy.choose(8) == 0
    alone = policy.round_times()[0]
    policy.observe(2, 1, 1.0e-3, 20e-6, 0, 0.0)  # a probe's round: the target alone next
    policy.observe(0, 0, 1.5e-3, 20e-6, 0, 0.0)  # beside the card's drafting ahead
    assert policy.round_times()[0] == pytest.approx(alone)
    policy.observe(0, 0, 0.6e-3, 20e-6, 0, 0.0)  # the card quiet: counted
    assert policy.round_times()[0] > alone


def test_bursts_of_plain_rounds_stop_for_the_next_probe() -> None:
    policy = AdaptiveK(8)
    simulate(policy, 300, acceptance=0.3, step_ms=0.5, per_token_ms=0.3, card_ms_per_token=0.15)
    burst = policy.plain_rounds()
    assert 0 < burst <= 16
    policy.observe_plain(burst, 0.5e-3, 20e-6)
    seen = [policy.choose(8) for _ in range(2000)]
    assert 1 in seen  # the probe still comes


class ScriptedK(KPolicy):
    """Drives the real decoder through a fixed schedule of K (a test's schedule, not a
    stand-in for anything a user runs)."""

    def __init__(self, schedule: list[int]) -> None:
        self.schedule = schedule
        self.at = 0

    def choose(self, max_k: int) -> int:
        k = self.schedule[min(self.at, len(self.schedule) - 1)]
        self.at += 1
        return min(k, max_k)

    # plain_rounds() stays 0: every round goes through choose(), so the schedule is followed


@pytest.fixture(scope="module")
def small() -> OnnxTarget:
    return OnnxTarget(demo_dir() / "target.img", positions=2048, threads=1)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return demo_tokenizer().encode("def read_config(path):\n").ids


def test_k_zero_rounds_never_ask_the_card(small: OnnxTarget, prompt: list[int]) -> None:
    reference = small.greedy(prompt, 150)
    with open_card(emulator_url()) as card:
        decoder = SpeculativeDecoder(card, small, draft=DRAFT_TARGET, k=0)
        result = decoder.generate(prompt, 150, stop_token_ids=[])
        stats = card.stats()
    assert result.tokens == reference
    assert stats["streams_opened"] == 0 and stats["draft_tokens"] == 0
    assert result.metrics.k_chosen == {0: 150} and result.metrics.rounds == 150


def test_switching_between_k_zero_and_drafting_stays_exact(
    small: OnnxTarget, prompt: list[int]
) -> None:
    # starts without a stream, opens one to draft, goes quiet long enough for the card to be
    # fed in the background, then drafts again after a catch-up
    schedule = [0] * 5 + [4] * 6 + [0] * 300 + [3] * 8 + [0] * 20 + [5] * 50
    reference = small.greedy(prompt, 400)
    with open_card(emulator_url()) as card:
        decoder = SpeculativeDecoder(
            card, small, draft=DRAFT_TARGET, k=ScriptedK(schedule), trees="off"
        )
        result = decoder.generate(prompt, 400, stop_token_ids=[])
        stats = card.stats()
    assert result.tokens == reference
    m = result.metrics
    assert m.k_chosen[0] > 300 and m.k_chosen[4] and m.k_chosen[3] and m.k_chosen[5]
    assert stats["streams_opened"] == 1 and stats["streams_open"] == 0
    # a round followed by K = 0 tells the card its outcome in the next PREFILL, not a COMMIT
    assert 0 < stats["accepted_tokens"] <= m.num_accepted_tokens


def test_the_pairs_limit_is_the_best_k_over_its_verify_cost() -> None:
    from exstill_sdk.harness.speedup import pair_limit

    verify = {"1": 10.0, "2": 11.0, "3": 12.0, "4": 20.0}
    taus = [2.0, 2.0 + 2 / 3, 3.0 + 1 / 6]
    # K=1: 2/1.1 = 1.82; K=2: 2.67/1.2 = 2.22; K=3: 3.17/2.0 = 1.58
    assert pair_limit(taus, verify) == (pytest.approx((2 + 2 / 3) / 1.2), 2)
    assert pair_limit([1.0, 1.0, 1.0], verify) == (1.0, 0)  # nothing kept: no gain
    assert pair_limit([*taus, 9.0], verify) == (pytest.approx((2 + 2 / 3) / 1.2), 2)  # no cost


def test_the_free_draft_keeps_what_a_fixed_k_decode_keeps(
    small: OnnxTarget, prompt: list[int]
) -> None:
    """The pair's limit reads the draft's own acceptance along the target's text: teacher-forced
    by onnxruntime, it keeps, at each K, exactly the tokens a pass that a fixed-K decode
    through the card keeps; a decode choosing K per round draws a higher acceptance by
    position (it drafts far where it trusts the text), which is why the run's is not used."""
    from exstill_sdk.demo.pair import draft_model, held_out_prompts
    from exstill_sdk.harness.speedup import FreeDraft

    prompts = [prompt, *held_out_prompts(2, 64)]
    texts = [small.greedy(p, 96) for p in prompts]
    verify = {str(n): 100.0 + 10 * n for n in range(1, 10)}  # a pass of n tokens
    free = FreeDraft.along(draft_model(), prompts, texts, verify, 8)
    assert len(free.taus) == 8
    with open_card(emulator_url()) as card:
        for k in (1, 4, 8):
            decoder = SpeculativeDecoder(card, small, draft=DRAFT_TARGET, k=k, trees="off")
            passes = 0
            for p, text in zip(prompts, texts, strict=True):
                result = decoder.generate(p, 96, stop_token_ids=[])
                assert result.tokens == text
                passes += result.metrics.rounds
            assert free.taus[k - 1] == pytest.approx(3 * 96 / passes)
        adaptive = SpeculativeDecoder(card, small, draft=DRAFT_TARGET, trees="off")
        for p in prompts:
            adaptive.generate(p, 96, stop_token_ids=[])
    by_k = [(verify[str(k + 1)] / verify["1"], tau) for k, tau in enumerate(free.taus, 1)]
    assert free.limit == pytest.approx(max(tau / cost for cost, tau in by_k))
    assert free.oracle >= free.limit  # each round's K known: at least as good as any one K
    assert free.taus == tuple(sorted(free.taus))  # a longer chain never keeps less


def test_figures_that_cannot_be_true_are_named() -> None:
    """The verify cost one loaded run printed (1.00 0.22 0.18 1.44 0.21 ...: nine tokens scored
    in a fifth of a plain step), and a speed-up above the pair's limit (efficiency 1.079)."""
    from exstill_sdk.harness.speedup import curve_doubt, limit_doubt

    loaded = {"1": 1000.0, "2": 220.0, "3": 180.0, "4": 1440.0, "5": 210.0}
    doubt = curve_doubt(loaded)
    assert doubt is not None and "2 tokens 0.22, 3 tokens 0.18, 5 tokens 0.21" in doubt
    assert curve_doubt({"1": 1000.0, "2": 950.0, "3": 1200.0}) is None  # noise, not impossible
    said = limit_doubt(2.16, 2.0)
    assert said is not None and "is above 2.00x, what a free draft choosing each round" in said
    assert limit_doubt(2.05, 2.0) is None
