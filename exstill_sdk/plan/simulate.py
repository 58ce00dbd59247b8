"""The model: U users decoding together, round by round, in virtual time.

Every round, one verification pass scores every user's draft and the token after it (a chain
of K: K + 1 tokens; a tree of N nodes: N + 1, at ``tree_pass`` times a chain's pass of as many
tokens; none for a user without a stream when the card's overflow is ``target-alone``); how
each round ends (the tokens accepted, the target's token after them) is drawn from the shape's
outcomes (shapes.py). Then, for each round:

    host      the host's acceptance and COMMITs (per round + per sequence drafting)
    link      half a round trip to the card, half back
    card      the card takes the round (a fixed cost) and every stream's COMMIT, and answers
              it from a draft made ahead (a prefetch hit: the round ended in an outcome it
              drafted ahead for) or drafts anew (a miss: a fixed cost, more for each further
              stream that missed, then the shape's steps, the first taking in the
              bonus, one a depth of the draft, the last giving what follows it); the card
              drafts ``parallel_streams`` rows at once, so that more streams, a tree's wider
              levels and more outcomes take more waves; if the drafting ahead it started
              after the last reply is not done, it waits
    ahead     after replying, the card drafts the next round ahead for every stream and each
              outcome it prefetches (``outcomes_ahead``) while the target verifies: hidden
              while the pass is longer

Plain decoding of the same U users is one step of U tokens a token. The output per (U, shape):
tokens/s in total and per user, the speed-up over plain, the mean acceptance length, and where
an average round's time goes. ``plan`` tries every shape and keeps the best (the same shape for
every user, as a fixed-shape deployment would run).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from exstill_sdk.plan.acceptance import Acceptance
from exstill_sdk.plan.profiles import CardProfile, TargetProfile
from exstill_sdk.plan.shapes import DraftShape, chain_shape, tree_shape

DRAFTS = 20000
"""Drafts simulated per (users, K), in at least ``MIN_ROUNDS`` rounds: enough that the mean
acceptance length is within about 1% of its expectation."""
MIN_ROUNDS = 200


@dataclass(frozen=True)
class RoundSplit:
    """Milliseconds of an average round."""

    step: float
    """What a plain step of the batch costs."""
    verify_extra: float
    """The verification pass beyond that: the extra tokens, the experts they wake."""
    host: float
    link: float
    card: float
    """Waiting for the card after the COMMITs arrived: drafting a miss, drafting ahead not yet
    done, its fixed cost."""


@dataclass(frozen=True)
class Projection:
    users: int
    k: int
    """Drafted tokens a sequence: K, or the tree's nodes."""
    shape: str
    tokens_per_s: float
    tokens_per_s_per_user: float
    plain_tokens_per_s: float
    speedup: float
    mean_acceptance_length: float
    prefetch_hit_rate: float
    outcomes_ahead: float
    """Outcomes a stream's next draft is made ahead for (the mean over the streams)."""
    streams_used: int
    waves: int
    round_ms: RoundSplit

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["round_ms"] = {k: round(v, 4) for k, v in asdict(self.round_ms).items()}
        for key in ("tokens_per_s", "tokens_per_s_per_user", "plain_tokens_per_s"):
            out[key] = round(out[key], 1)
        for key in ("speedup", "mean_acceptance_length", "prefetch_hit_rate", "outcomes_ahead"):
            out[key] = round(out[key], 3)
        return out


def simulate(
    target: TargetProfile,
    card: CardProfile,
    acceptance: Acceptance,
    users: int,
    shape: DraftShape | int,
    *,
    rounds: int | None = None,
    seed: int = 0,
) -> Projection:
    """U users drafting ``shape`` (a DraftShape, or K for a chain of K) for ``rounds`` rounds
    (default: ``DRAFTS`` drafts' worth; module docstring)."""
    if isinstance(shape, int):
        shape = chain_shape(acceptance, shape)
    capacity = card.streams * card.cards
    drafting = users if card.overflow == "waves" else min(users, capacity)
    if not shape.size:
        drafting = 0
    tokens = users + drafting * shape.size
    step = target.step_ms(users)
    verify = target.verify_ms(users, tokens) * (target.tree_pass if shape.kind == "tree" else 1)
    host = (card.host_us_per_round + card.host_us_per_sequence * drafting) / 1e3
    plain_rate = users / step * 1e3
    if not drafting:  # the target alone, through the host's loop
        rate = users / (verify + host) * 1e3
        split = RoundSplit(step, verify - step, host, 0.0, 0.0)
        return Projection(
            users, 0, str(shape), rate, rate / users, plain_rate, rate / plain_rate, 1.0, 0.0,
            0, 0, 0, split,
        )  # fmt: skip
    verify *= card.target_slowdown  # the card drafts beside the pass, or just before it
    rtt = card.link_rtt_us / 1e3
    each = outcomes_ahead(card, shape, drafting, verify + host + rtt)
    widths = np.array(each)
    if rounds is None:
        rounds = max(MIN_ROUNDS, DRAFTS // drafting)
    rng = np.random.default_rng(seed)
    cumulative = np.cumsum(shape.chance)
    ends = np.searchsorted(cumulative, rng.random((rounds, drafting)) * cumulative[-1])
    ends = np.minimum(ends, len(shape.chance) - 1)  # which outcome each round ends in
    accepted = shape.accepted[ends]
    named = shape.named(card.candidates)
    rank = np.full(len(shape.chance), len(named))  # where an outcome is in the card's order
    rank[named] = np.arange(len(named))
    hits = rank[ends] < widths  # each stream's round, against that stream's outcomes ahead
    ahead = card.ahead_us(shape, each) / 1e3
    commit = card.round_us + card.commit_us * drafting
    clock = card_free = waited = 0.0
    for r in range(rounds):
        arrive = clock + verify + host + rtt / 2
        misses = drafting - int(hits[r].sum())
        start = max(arrive, card_free)
        miss = (
            card.miss_us + card.miss_stream_us * (misses - 1) + card.drafting_us(misses, shape)
        ) * (misses > 0)
        done = start + (commit + miss) / 1e3
        waited += done - arrive
        card_free = done + ahead
        clock = done + rtt / 2
    emitted = (accepted + 1).sum() + (users - drafting) * rounds
    rate = float(emitted / clock * 1e3)
    split = RoundSplit(step, verify - step, host, rtt, waited / rounds)
    return Projection(
        users=users,
        k=shape.size,
        shape=str(shape),
        tokens_per_s=rate,
        tokens_per_s_per_user=rate / users,
        plain_tokens_per_s=plain_rate,
        speedup=rate / plain_rate,
        mean_acceptance_length=float((accepted + 1).mean()),
        prefetch_hit_rate=float(hits.mean()),
        outcomes_ahead=float(widths.mean()),
        streams_used=min(users, capacity),
        waves=card.waves(drafting),
        round_ms=split,
    )


def outcomes_ahead(
    card: CardProfile, shape: DraftShape, streams: int, window_ms: float
) -> list[int]:
    """Outcomes the card drafts the next round ahead for, for each of ``streams`` streams: none
    without prefetch (or for a tree on a card that drafts trees when their COMMIT comes); full
    acceptance alone (``full-acceptance``); or, with it, as many of the likeliest as fit in
    ``outcome_share`` of the time from its reply to the next COMMITs (``outcomes``), as the
    firmware plans them (firmware/outcomes.py), at most ``max_outcomes``, among those whose
    bonus is one of its ``candidates`` alternatives. As rows of one batched drafting, every
    stream takes as many; in outcome trees of their own (``outcome_pass_us``), the streams'
    next likeliest outcomes are taken in turn while their passes fit in what drafting ahead
    for full acceptance leaves, a stream's first paying its passes' fixed part
    (``plan_outcomes``)."""
    if not card.drafts_ahead(shape):
        return [0] * streams
    if card.prefetch == "full-acceptance":
        return [1] * streams
    most = min(card.max_outcomes, len(shape.named(card.candidates)))
    budget = card.outcome_share * window_ms * 1e3
    if card.outcome_pass_us is None:
        m = 1
        while m < most and card.drafting_us(streams * (m + 1), shape, ahead=True) <= budget:
            m += 1
        return [m] * streams
    widths = [1] * streams
    left = budget - card.ahead_us(shape, widths)
    for _ in range(most - 1):
        for s in range(streams):
            first = card.outcome_pass_us if widths[s] == 1 else 0.0
            price = len(shape.steps) * (first + card.outcome_us)
            if price <= left:
                left -= price
                widths[s] += 1
    return widths


SHAPES_TREE = (4, 8, 12, 16, 24, 32, 48, 64)
"""Tree sizes the planner tries, up to the card's ``max_tree_nodes``."""


def shapes(card: CardProfile, acceptance: Acceptance) -> list[DraftShape]:
    """Every shape the planner weighs: chains of 0..max_k, and trees where the acceptance
    profile says how often the draft's other choices are right."""
    out = [chain_shape(acceptance, k) for k in range(card.max_k + 1)]
    if acceptance.rank_share:
        out += [tree_shape(acceptance, n) for n in SHAPES_TREE if n <= card.max_tree_nodes]
    return out


def plan(
    target: TargetProfile,
    card: CardProfile,
    acceptance: Acceptance,
    users: int,
    shape: DraftShape | int | None = None,
    *,
    rounds: int | None = None,
) -> tuple[Projection, dict[str, float]]:
    """The projection with ``shape`` (K for a chain), or with the best of ``shapes`` when it
    is None; and the tokens/s of every shape tried, by name."""
    tried = [shape] if shape is not None else shapes(card, acceptance)
    runs = [simulate(target, card, acceptance, users, s, rounds=rounds) for s in tried]
    best = max(runs, key=lambda p: p.tokens_per_s)
    return best, {p.shape: p.tokens_per_s for p in runs}
