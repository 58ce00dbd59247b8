"""Drafting ahead for several verification outcomes (firmware/outcomes.py): which outcomes are
ranked and planned, the transformer engine's outcome drafts against HF's greedy continuation
and against the chain the engine itself drafts after each outcome, and rounds on the wire
answered from them exactly as a card without prefetch answers."""

from __future__ import annotations

import itertools
import struct

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from exstill_firmware import CardRuntime  # noqa: E402
from exstill_firmware.engines.base import Sampling  # noqa: E402
from exstill_firmware.engines.hybrid import HybridEngine  # noqa: E402
from exstill_firmware.engines.sampling import ranking_probs  # noqa: E402
from exstill_firmware.engines.transformer import TransformerEngine  # noqa: E402
from exstill_firmware.outcomes import (  # noqa: E402
    CANDIDATES,
    Outcome,
    PassCost,
    plan_outcomes,
    rank_outcomes,
)

from exstill_sdk.card import Card  # noqa: E402
from exstill_sdk.image import open_image  # noqa: E402
from exstill_sdk.protocol.constants import WireMode  # noqa: E402
from exstill_sdk.protocol.drafts import Verdict  # noqa: E402
from exstill_sdk.transport.emu import EmuTransport  # noqa: E402

from .test_transformer import generate, tokens, unpack  # noqa: E402


def pack(ids: list[int]) -> bytes:
    return struct.pack(f"<{len(ids)}I", *ids)


ROUNDING = 4
"""u16 weights (of 65,535) by which a sampled draft's distribution may differ from the chain's:
an outcome's draft (and a draft finished after one) comes from keys, values and logits of the
tree graph, whose arithmetic differs from the chain step's by float rounding; each token is
drawn from exactly the weights sent with it."""
TEMPERATURE = 0.5
"""A rank temperature for the pure ranking tests."""


def assert_same_draft(got, want) -> None:
    """The same tokens, and for sampled drafts the same distributions to ROUNDING."""
    assert got.tokens == want.tokens
    assert (got.dists is None) == (want.dists is None)
    for a, b in zip(got.dists or (), want.dists or (), strict=True):
        assert a.tokens == b.tokens
        assert np.abs(np.subtract(a.weights, b.weights)).max() <= ROUNDING


# ---------------------------------------------------------------- ranking and planning


@pytest.mark.parametrize("seed", range(5))
def test_outcomes_are_ranked_as_brute_force_scores_them(seed: int) -> None:
    rng = np.random.default_rng(seed)
    k, vocab = 5, 12
    logits = rng.normal(0, 2, (k + 1, vocab)).astype(np.float32)
    drafted = [int(rng.integers(vocab)) for _ in range(k + 1)]  # a sampled draft: any token
    probs = ranking_probs(logits, TEMPERATURE)
    everything = {}
    for j in range(k + 1):
        reach = float(np.prod([probs[i, drafted[i]] for i in range(j)]))
        top = np.argsort(-probs[j], kind="stable")[: CANDIDATES + 1]
        for b in top.tolist():
            if b != drafted[j]:
                everything[(j, b)] = reach * probs[j, b]
    ranked = rank_outcomes(drafted, logits, 7, TEMPERATURE)
    assert len(ranked) == 7
    want = sorted(everything.values(), reverse=True)[:7]
    assert [o.score for o in ranked] == pytest.approx(want, rel=1e-5)
    for o in ranked:
        assert everything[(o.accepted, o.bonus)] == pytest.approx(o.score, rel=1e-5)
    # never the outcome the prefetcher drafts first: all accepted and the guess
    assert all((o.accepted, o.bonus) != (k, drafted[k]) for o in ranked)


def test_pass_cost_is_fitted_from_timed_passes() -> None:
    cost = PassCost()
    assert cost.fit() is None
    cost.chain_step(0.0004)  # before any pass is timed: two chain steps, a quarter an outcome
    assert cost.fit() == pytest.approx((0.0008, 0.0001))
    cost.add(4, 0.002)
    a, b = cost.fit()  # one width: half fixed
    assert a == pytest.approx(0.001) and a + 4 * b == pytest.approx(0.002)
    for width in (2, 6, 10, 3):
        cost.add(width, 0.0003 + 0.00005 * width)
    cost = PassCost()
    for width in (2, 6, 10, 3):
        cost.add(width, 0.0003 + 0.00005 * width)
    assert cost.fit() == pytest.approx((0.0003, 0.00005))


def test_plan_takes_the_likeliest_outcomes_that_fit() -> None:
    cost = PassCost()
    for width in (1, 5):
        cost.add(width, 0.001 + 0.0001 * width)  # a pass: 1 ms fixed, 0.1 ms an outcome
    a = [Outcome(s, 0, i) for i, s in enumerate([0.5, 0.3, 0.2, 0.1])]
    b = [Outcome(s, 1, 10 + i) for i, s in enumerate([0.4, 0.25, 0.05])]
    jobs = [(a, 4, 8), (b, 4, 8)]  # 4 passes each
    # 4 passes of stream a with 2 outcomes: 4 * (1 + 0.2) = 4.8 ms; stream b's first outcome
    # would add 4 * 1.1 ms
    plan = plan_outcomes(jobs, 0.0050, cost.fit())
    assert [(p.job, p.roots) for p in plan] == [(0, [(0, 0), (0, 1)])]
    # 4.4 ms for a's first, 4.4 ms for b's first, 0.4 ms for a's second: 9.2 ms of 9.5
    plan = plan_outcomes(jobs, 0.0095, cost.fit())
    assert [(p.job, p.roots) for p in plan] == [(0, [(0, 0), (0, 1)]), (1, [(1, 10)])]
    # every stream's outcomes, within the most a stream may have
    plan = plan_outcomes([(a, 4, 3), (b, 4, 8)], 1.0, cost.fit())
    assert [len(p.roots) for p in plan] == [3, 3]
    assert plan_outcomes(jobs, 0.0, cost.fit()) == []
    assert plan_outcomes(jobs, 1.0, PassCost().fit()) == []  # nothing timed: no plan


# ---------------------------------------------------------------- the engine


def drafted_ahead(state, context: list[int], k: int) -> tuple[list[int], np.ndarray]:
    """A chain round as the card makes one with outcomes on: k tokens and the guess."""
    state.keep_logits = True
    proposal = state.propose(k + 1)
    assert proposal.logits is not None and len(proposal.logits) == k + 1
    return unpack(proposal.tokens), proposal.logits


def test_outcome_drafts_are_hf_greedy_continuations(model_pair) -> None:
    model, image, _ = model_pair
    engine = TransformerEngine(open_image(image), rows=2, positions=256)
    state = engine.open_state(256, Sampling())
    context = tokens(20)
    state.extend(pack(context))
    k = 5
    drafted, logits = drafted_ahead(state, context, k)
    assert drafted == generate(model, context, k + 1)
    ranked = rank_outcomes(drafted, logits, 9, TEMPERATURE)
    roots = [(o.accepted, o.bonus) for o in ranked] + [(2, 7), (0, 3)]  # and two unlikely ones
    drafts = state.draft_outcomes(pack(drafted[:k]), roots, k + 1, lambda: False)
    assert drafts is not None and len(drafts) == len(roots)
    for (j, b), made in zip(roots, drafts, strict=True):
        committed = [*drafted[:j], b]
        assert unpack(made.committed) == committed
        assert unpack(made.proposal.tokens) == generate(model, context + committed, k + 1)
    # the stream's own draft is still cached: the chain drafted next is HF's again
    assert unpack(state.propose(k + 1).tokens) == drafted
    # committing an outcome keeps its cache entries: the next chain goes on from them
    (j, b), made = roots[3], drafts[3]
    state.extend(made.committed)
    state.adopt_outcome(made)
    context += unpack(made.committed)
    assert unpack(state.cached) == context + unpack(made.proposal.tokens)[:k]
    assert unpack(state.propose(k + 1).tokens) == generate(model, context, k + 1)


def test_outcome_drafts_of_a_sampled_stream_are_its_own_chains(model_pair) -> None:
    _, image, _ = model_pair
    engine = TransformerEngine(open_image(image), rows=3, positions=256)
    sampling = Sampling(temperature=0.9, top_k=20, seed=11, max_entries=255)
    context = tokens(16, seed=3)
    state = engine.open_state(256, sampling)
    state.extend(pack(context))
    k = 4
    drafted, logits = drafted_ahead(state, context, k)
    roots = [(o.accepted, o.bonus) for o in rank_outcomes(drafted, logits, 6, TEMPERATURE)]
    drafts = state.draft_outcomes(pack(drafted[:k]), roots, k + 1, lambda: False)
    assert drafts is not None
    for made in drafts:
        fresh = engine.open_state(256, sampling)
        fresh.extend(pack(context) + made.committed)
        want = fresh.propose(k + 1)
        fresh.close()
        assert made.proposal.dists is not None
        assert_same_draft(made.proposal, want)


def test_stopped_outcome_drafts_are_begun_drafts_a_commit_finishes(model_pair) -> None:
    model, image, _ = model_pair
    engine = TransformerEngine(open_image(image), rows=2, positions=256)
    state = engine.open_state(256, Sampling())
    context = tokens(12, seed=5)
    state.extend(pack(context))
    drafted, logits = drafted_ahead(state, context, 4)
    calls = itertools.count()
    roots = [(o.accepted, o.bonus) for o in rank_outcomes(drafted, logits, 5, TEMPERATURE)]
    begun = state.draft_outcomes(pack(drafted[:4]), roots, 5, lambda: next(calls) >= 2)
    assert next(calls) == 3  # asked before each pass: two passes ran, the third was stopped
    assert begun is not None
    for (j, b), made in zip(roots, begun, strict=True):  # two tokens each, HF's
        committed = [*drafted[:j], b]
        assert unpack(made.proposal.tokens) == generate(model, context + committed, 2)
    assert state.draft_outcomes(pack(drafted[:4]), roots, 5, lambda: True) is None  # no pass
    # a draft that is not the one cached, or an outcome beyond it: nothing is drafted
    assert state.draft_outcomes(pack([1, 2, 3, 4]), roots, 5, lambda: False) is None
    assert state.draft_outcomes(pack(drafted[:4]), [(5, 1)], 5, lambda: False) is None
    # the COMMIT of a begun outcome: its cache entries kept, the rest drafted after them
    made = begun[2]
    state.extend(made.committed)
    state.adopt_outcome(made)
    context += unpack(made.committed)
    rest = state.finish_draft(3, made.proposal.tokens)
    assert unpack(made.proposal.tokens + rest.tokens) == generate(model, context, 5)
    # and a stream whose drafts were begun but not committed drafts as before
    assert unpack(state.propose(4).tokens) == generate(model, context, 4)


def test_a_lookup_stream_drafts_ahead_only_where_lookup_has_nothing(model_pair) -> None:
    """Behind prompt lookup (OpenFlags.LOOKUP) the draft after an outcome whose text repeats
    is lookup's, not the model's: the card does not draft ahead for it."""
    _, image, _ = model_pair
    hybrid = HybridEngine(TransformerEngine(open_image(image), rows=2, positions=256))
    state = hybrid.open_state(256, Sampling())
    b, c, d, e, q = 40, 41, 42, 43, 44
    context = [10, 11, 12, b, c, d, e, 13, 14, 15, q, b, c]  # "b c d" before; ends "q b c"
    state.extend(pack(context))
    drafted, _ = drafted_ahead(state, context, 3)  # the model's: lookup has no match yet
    made = state.draft_outcomes(pack(drafted[:3]), [(0, d), (0, 77)], 4, lambda: False)
    assert made is not None
    assert [unpack(m.committed) for m in made] == [[77]]  # after d, lookup has "b c d"


# ---------------------------------------------------------------- rounds on the wire


def card_pair(image, wire_mode: WireMode, temperature: float) -> list:
    """The same stream on a card that drafts ahead for outcomes (served as a link serves:
    prefetch work run between requests) and on one without prefetch."""
    out = []
    for prefetch in (True, False):
        runtime = CardRuntime(2, 512, [TransformerEngine(open_image(image), rows=2)],
                              prefetch=prefetch, background_prefetch=False)  # fmt: skip
        card = Card(EmuTransport(runtime, owns_runtime=True))
        stream = card.open_stream(
            target=next(iter(runtime.models)),
            temperature=temperature,
            top_k=20,
            seed=4,
            wire_mode=wire_mode,
        )
        out.append((runtime, card, stream))
    return out


@pytest.mark.parametrize(
    ("wire_mode", "temperature"), [(WireMode.TOKENS, 0.0), (WireMode.DIST, 0.8)]
)
def test_rounds_answered_from_outcome_drafts_are_the_drafts_made_without(
    model_pair, wire_mode: WireMode, temperature: float
) -> None:
    _, image, _ = model_pair
    (runtime, card, stream), (_, plain_card, plain) = card_pair(image, wire_mode, temperature)
    rng = np.random.default_rng(1)
    prompt = tokens(24, seed=2)
    stream.prefill(prompt)
    plain.prefill(prompt)
    k = 6
    draft, want = stream.draft(k), plain.draft(k)
    ahead = runtime.streams.by_handle[stream.handle]
    for _ in range(40):
        assert_same_draft(draft, want)
        ahead.window = 60.0  # a host that takes a minute to verify: time for every outcome
        # ... or a host whose next request comes after a few passes: outcome drafts begun
        passes = itertools.count()
        cut = int(rng.integers(2, 6)) if rng.random() < 0.5 else 10**6
        runtime.run_prefetch(lambda: next(passes) >= cut)  # noqa: B023 - used right here
        made = ahead.outcomes.drafts if ahead.outcomes is not None else {}
        if made and rng.random() < 0.7:  # mostly an outcome drafted ahead, sometimes not
            committed = unpack(list(made)[int(rng.integers(len(made)))])
            verdict = Verdict(len(committed) - 1, committed[-1])
        else:
            verdict = Verdict(int(rng.integers(k + 1)), int(rng.integers(3, 96)))
        draft, want = stream.commit(verdict, k), plain.commit(verdict, k)
    stats = card.stats()
    assert stats["prefetch_outcome_hits"] >= 6
    assert stats["prefetch_outcome_partial"] >= 3  # begun drafts finished at the COMMIT
    assert stats["prefetch_hits"] >= stats["prefetch_outcome_hits"]
    short = sum(v for key, v in stats.items() if key.startswith("prefetch_hits.accepted_"))
    assert short == stats["prefetch_hits"]
    assert any(stats.get(f"prefetch_hits.accepted_{j}", 0) for j in range(k))  # not only full
    assert stats["prefetch_wasted_tokens"] > 0
    # the card timed its outcome trees' passes: each at least one outcome wide, at most 16
    passes, width = stats["outcome_passes"], stats["outcome_pass_width"]
    assert passes > 0 and passes <= width <= 16 * passes and stats["outcome_pass_us"] > 0
    assert plain_card.stats()["outcome_passes"] == 0
    assert plain_card.stats()["prefetch_hits"] == 0
    card.close()
    plain_card.close()


def test_a_card_without_outcome_prefetch_drafts_ahead_for_full_acceptance_only(
    model_pair,
) -> None:
    _, image, _ = model_pair
    runtime = CardRuntime(2, 512, [TransformerEngine(open_image(image), rows=2)],
                          background_prefetch=False, prefetch_outcomes=False)  # fmt: skip
    card = Card(EmuTransport(runtime, owns_runtime=True))
    stream = card.open_stream(target=next(iter(runtime.models)))
    stream.prefill(tokens(10))
    draft = stream.draft(4)
    ahead = runtime.streams.by_handle[stream.handle]
    ahead.window = 60.0
    runtime.run_prefetch()
    assert ahead.prefetch is not None and ahead.outcomes is None and ahead.logits is None
    stream.commit(Verdict(1, (draft.tokens[1] + 1) % 90 + 3), 4)
    stats = card.stats()
    assert stats["prefetch_misses"] == 1 and stats["prefetch_outcome_hits"] == 0
    # the card timed its drafting ahead: K + 1 steps of one stream
    assert (stats["ahead_steps"], stats["ahead_step_streams"]) == (5, 5)
    assert stats["ahead_step_us"] > 0
    card.close()


def test_no_outcome_is_ranked_when_none_fits_before_the_commit(model_pair, monkeypatch) -> None:
    """Ranking a draft's outcomes takes a softmax over every position's vocabulary: where not
    one outcome's passes fit before the host's COMMIT is due, the card does not rank them (on
    the small demo target at one user that work alone delayed every reply by about 0.45 ms)."""
    import exstill_firmware.prefetch as prefetch

    _, image, _ = model_pair
    ranked = []
    real = prefetch.rank_outcomes
    monkeypatch.setattr(prefetch, "rank_outcomes", lambda *a: ranked.append(1) or real(*a))
    runtime = CardRuntime(2, 512, [TransformerEngine(open_image(image), rows=2)],
                          background_prefetch=False)  # fmt: skip
    card = Card(EmuTransport(runtime, owns_runtime=True))
    stream = card.open_stream(target=next(iter(runtime.models)))
    stream.prefill(tokens(10))
    draft = stream.draft(4)
    ahead = runtime.streams.by_handle[stream.handle]
    for window, ranks in ((1e-9, 0), (60.0, 1)):
        ahead.window = window
        runtime.run_prefetch()
        assert len(ranked) == ranks
        draft = stream.commit(Verdict(4, draft.tokens[-1] if draft.tokens else 5), 4)
    card.close()
