"""Replaying a K policy over a text's acceptance record, in virtual time.

Under greedy drafting and greedy verification, whether a round keeps a drafted token is a
property of the text alone: the draft's greedy token after the text's own prefix is the
target's token there, or not (``kept[t]`` for generated token t; ``record_kept`` reads it from
a card). A round at K that starts at t keeps the run of kept positions from t, at most K of
them, then the target's own token. So one record tells what any K policy would have done on
that text, round by round, and a cost table (the target's pass by tokens scored, the host's
share of a round, the card's wait) what it would have cost. A policy's loss to the best fixed
K is then measured without the machine's noise, and two policies replayed on the same texts
differ only by what they chose.

The replay drives the policy as ``rounds.PolicyPlanner`` and the decoder do: a round's
acceptance is told at once, its costs with the pass after it; rounds of the target alone run
as the decoder's bursts. What it models rather than runs is the card: a round whose K is at
most the K of the draft before it finds its draft made ahead where the card had the time
(``_card_wait``); a longer one, an outcome it had no time for, and the first draft after rounds
of the target alone wait for the card to draft anew (``card_token_s`` a token, and the catch-up
on the tokens it missed); each pays the round trip (``card_hit_s``).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from exstill_sdk.errors import InvalidArgumentError
from exstill_sdk.interface import CardInterface
from exstill_sdk.speculative.adaptive import KPolicy


@dataclass(frozen=True)
class RoundCosts:
    """What a round costs, in seconds, as measured on a pair."""

    verify_s: tuple[float, ...]
    """The target's pass scoring n tokens of one sequence, index n - 1 (n = 1: a plain step)."""
    host_s: float
    """The host's share of a round (acceptance, bookkeeping), card wait aside."""
    card_hit_s: float
    """The card's answer to a COMMIT whose draft it made ahead: the round trip."""
    card_token_s: float
    """The card's seconds per token drafted (or caught up on), ahead or anew."""
    plain_s: float
    """A step of the target's own greedy loop: the baseline a speed-up is against."""
    prompt_s: float = 0.0
    """The target's pass over the prompt, which speculative and plain decoding both pay."""

    def __post_init__(self) -> None:
        if not self.verify_s or min(self.verify_s) <= 0:
            raise InvalidArgumentError("verify_s needs a positive time for n = 1 at least")

    def verify(self, n: int) -> float:
        """The pass for n tokens: measured, or beyond the table its last two points' line."""
        table = self.verify_s
        if n <= len(table):
            return table[n - 1]
        slope = table[-1] - table[-2] if len(table) > 1 else 0.0
        return table[-1] + slope * (n - len(table))


@dataclass
class Replayed:
    """A policy's run over one text."""

    tokens: int
    seconds: float = 0.0
    rounds: int = 0
    accepted: int = 0
    card_s: float = 0.0
    """Of ``seconds``, the rounds' waits for the card."""
    k_chosen: Counter[int] = field(default_factory=Counter)

    def speedup(self, costs: RoundCosts) -> float:
        """Over the target's own greedy loop on the same text, the prompt's pass in both."""
        return (costs.prompt_s + costs.plain_s * self.tokens) / (costs.prompt_s + self.seconds)


def kept_run(kept: Sequence[bool], start: int, k: int) -> int:
    """Drafted tokens a round at K starting at generated token ``start`` keeps."""
    accepted = 0
    while accepted < k and kept[start + accepted]:
        accepted += 1
    return accepted


def replay(
    policy: KPolicy,
    kept: Sequence[bool],
    costs: RoundCosts,
    max_k: int,
    *,
    jitter: float = 0.0,
    seed: int = 0,
) -> Replayed:
    """``policy`` generating ``len(kept)`` tokens of the text ``kept`` records, as one
    sequence of a decoder whose longest draft is ``max_k`` (module docstring). ``jitter``: each
    pass takes its table time times a factor drawn uniformly within that fraction of 1 (a
    shared machine's spread), the same draws for every policy of a ``seed``."""
    n = len(kept)
    if n < 1:
        raise InvalidArgumentError("a replay needs a text of at least one token")
    out = Replayed(n)
    t = 0
    draws = random.Random(seed)

    def verify(tokens: int) -> float:
        return costs.verify(tokens) * (1.0 + jitter * (2.0 * draws.random() - 1.0))

    def limit() -> int:
        return max(0, min(max_k, n - t - 1))

    policy.start_sequence()
    k = policy.choose(limit())  # the first draft: a catch-up on the prompt, not a round's cost
    out.k_chosen[k] += 1
    accepted = 0
    last: tuple[int, int, float] | None = None  # the round before the pass: K, accepted, pass
    between: tuple[float, float, int] | None = None  # that round's host and card time, next K
    while t < n:
        burst = policy.plain_rounds() if k == 0 else 0
        if burst > 1:  # the decoder's rounds of the target alone, one observation for all
            done = min(burst, n - t)
            verify_s = sum(verify(1) for _ in range(done)) / done
            out.seconds += done * (verify_s + costs.host_s)
            out.rounds += done
            out.k_chosen[0] += done - 1
            t += done
            policy.observe_plain(done, verify_s, costs.host_s)
            last = between = None
        else:
            verify_s = verify(k + 1)
            out.seconds += verify_s
            if last is not None and between is not None:
                policy.observe(*last, between[0], between[2], between[1])
            accepted = kept_run(kept, t, min(k, n - t - 1))
            policy.observe_acceptance(k, accepted)
            last = (k, accepted, verify_s)
            out.rounds += 1
            out.accepted += accepted
            t += accepted + 1
        if t >= n:
            break
        before, k = k, policy.choose(limit())
        out.k_chosen[k] += 1
        card, drafted = 0.0, k
        if k:
            if not before:  # the card catches up on what it missed, then drafts
                card, drafted = costs.card_token_s * (k + 1), 0  # not what a draft costs
            else:  # kept[t - 1]: the draft's own token where the target's bonus token went
                card = _card_wait(costs, before, k, accepted, kept[t - 1])
            card += costs.card_hit_s
        out.seconds += costs.host_s + card
        out.card_s += card
        between = (costs.host_s, card, drafted)
    return out


def _card_wait(costs: RoundCosts, k: int, next_k: int, accepted: int, guessed: bool) -> float:
    """Beyond the round trip, what the card takes to answer a COMMIT for ``next_k`` after a
    round that drafted ``k`` and kept ``accepted`` (``guessed``: the draft's own next token was
    the target's bonus token). The card drafts ahead k + 1 tokens on the branch it expects (all
    kept, its guess for the bonus), beside the pass and the host's round (``window``); then, in
    the time left, other outcomes. An answer from a branch drafted ahead waits for what of that
    drafting did not fit; one whose outcome was not drafted ahead, or longer than k, waits for
    ``next_k`` tokens drafted anew."""
    window = costs.verify(k + 1) + costs.host_s
    branch = costs.card_token_s * (k + 1)
    if next_k <= k and accepted == k and guessed:
        return max(0.0, branch - window)
    if next_k <= k and 2 * branch <= window:  # room for other outcomes after the branch
        return 0.0
    return costs.card_token_s * next_k


def record_kept(
    card: CardInterface, draft: str, prompt: Sequence[int], output: Sequence[int]
) -> list[bool]:
    """For each token of ``output`` (the target's greedy continuation of ``prompt``): whether
    the card's draft ``draft``, greedy after the prompt and the output before it, proposes it."""
    kept = []
    with card.open_stream(target=draft) as stream:
        stream.prefill(list(prompt))
        for token in output:
            kept.append(stream.draft(1).tokens[:1] == (token,))
            stream.prefill([token])
    return kept
