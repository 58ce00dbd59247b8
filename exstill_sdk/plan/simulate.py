"""The model: U users decoding together, round by round, in virtual time.

Every round, one verification pass scores every user's K + 1 tokens (K = 0 for a user without a
stream when the card's overflow is ``target-alone``); how many of each draft are accepted is
drawn from the acceptance profile. Then, for each round:

    host      the host's acceptance and COMMITs (per round + per sequence drafting)
    link      half a round trip to the card, half back
    card      the card takes every stream's COMMIT and answers it from its draft made ahead
              (prefetch hit: every token accepted and its guess of the bonus right) or drafts
              anew (a miss: a fixed cost, then K + 1 steps of the draft, the first taking in the
              bonus, the last giving the card's guess of the next bonus); a wave of streams
              drafts at once, more streams take more waves; if the drafting ahead it started
              after the last reply is not done, it waits
    ahead     after replying, the card drafts the next round ahead for every stream (K + 1
              steps from its guess) while the target verifies: hidden while the pass is longer

Plain decoding of the same U users is one step of U tokens a token. The output per (U, K):
tokens/s in total and per user, the speed-up over plain, the mean acceptance length, and where
an average round's time goes. ``plan`` tries every K and keeps the best (one chain per user,
the same K for all, as a fixed-K deployment would run).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from exstill_sdk.plan.acceptance import Acceptance
from exstill_sdk.plan.profiles import CardProfile, TargetProfile

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
    tokens_per_s: float
    tokens_per_s_per_user: float
    plain_tokens_per_s: float
    speedup: float
    mean_acceptance_length: float
    prefetch_hit_rate: float
    streams_used: int
    waves: int
    round_ms: RoundSplit

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["round_ms"] = {k: round(v, 4) for k, v in asdict(self.round_ms).items()}
        for key in ("tokens_per_s", "tokens_per_s_per_user", "plain_tokens_per_s"):
            out[key] = round(out[key], 1)
        for key in ("speedup", "mean_acceptance_length", "prefetch_hit_rate"):
            out[key] = round(out[key], 3)
        return out


def simulate(
    target: TargetProfile,
    card: CardProfile,
    acceptance: Acceptance,
    users: int,
    k: int,
    *,
    rounds: int | None = None,
    seed: int = 0,
) -> Projection:
    """U users at a fixed K for ``rounds`` rounds (default: ``DRAFTS`` drafts' worth; module
    docstring)."""
    capacity = card.streams * card.cards
    drafting = users if card.overflow == "waves" else min(users, capacity)
    if not k:
        drafting = 0
    tokens = users + drafting * k
    step = target.step_ms(users)
    verify = target.verify_ms(users, tokens)
    host = (card.host_us_per_round + card.host_us_per_sequence * drafting) / 1e3
    plain_rate = users / step * 1e3
    if not drafting:  # the target alone, through the host's loop
        rate = users / (verify + host) * 1e3
        split = RoundSplit(step, verify - step, host, 0.0, 0.0)
        return Projection(
            users, 0, rate, rate / users, plain_rate, rate / plain_rate, 1.0, 0.0, 0, 0, split
        )
    rtt = card.link_rtt_us / 1e3
    reach = np.array([acceptance.at(i) for i in range(1, k + 2)])
    if rounds is None:
        rounds = max(MIN_ROUNDS, DRAFTS // drafting)
    rng = np.random.default_rng(seed)
    draws = rng.random((rounds, drafting))
    accepted = (draws[:, :, None] < reach[None, None, :k]).sum(axis=2)
    hits = draws < reach[k] if card.prefetch == "full-acceptance" else np.zeros_like(draws, bool)
    ahead = card.draft_us(drafting, k + 1) / 1e3 if card.prefetch != "none" else 0.0
    commit = card.commit_us * drafting
    clock = card_free = waited = 0.0
    for r in range(rounds):
        arrive = clock + verify + host + rtt / 2
        misses = drafting - int(hits[r].sum())
        start = max(arrive, card_free)
        miss = (card.miss_us + card.draft_us(misses, k + 1)) * (misses > 0)
        done = start + (commit + miss) / 1e3
        waited += done - arrive
        card_free = done + ahead
        clock = done + rtt / 2
    emitted = (accepted + 1).sum() + (users - drafting) * rounds
    rate = float(emitted / clock * 1e3)
    split = RoundSplit(step, verify - step, host, rtt, waited / rounds)
    return Projection(
        users=users,
        k=k,
        tokens_per_s=rate,
        tokens_per_s_per_user=rate / users,
        plain_tokens_per_s=plain_rate,
        speedup=rate / plain_rate,
        mean_acceptance_length=float((accepted + 1).mean()),
        prefetch_hit_rate=float(hits.mean()),
        streams_used=min(users, capacity),
        waves=card.waves(drafting),
        round_ms=split,
    )


def plan(
    target: TargetProfile,
    card: CardProfile,
    acceptance: Acceptance,
    users: int,
    k: int | None = None,
    *,
    rounds: int | None = None,
) -> tuple[Projection, dict[int, float]]:
    """The projection at ``k``, or at the best K of 0..card.max_k when ``k`` is None; and the
    tokens/s of every K tried."""
    ks = [k] if k is not None else list(range(card.max_k + 1))
    tried = {kk: simulate(target, card, acceptance, users, kk, rounds=rounds) for kk in ks}
    best = max(tried.values(), key=lambda p: p.tokens_per_s)
    return best, {kk: p.tokens_per_s for kk, p in tried.items()}
