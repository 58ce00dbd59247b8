"""Choosing K, the number of tokens to draft next.

``FixedK(k)`` always asks for k. ``AdaptiveK`` picks the K that maximises emitted tokens per
second of round time. One AdaptiveK serves every sequence of a decoder: what a round costs is
the target's and the card's, not a sequence's.

The formula, from measurements:

    E[tokens](K) = 1 + sum_{i=1..K} prod_{j=1..i} a_j
    T(K)         = c + v(K + 1) + w(K)
    K*           = argmax_{0 <= K <= max_k} E[tokens](K) / T(K)

a_j is the measured probability that drafted position j is accepted given that all before it
were, in this sequence's text: its counts there (halved every 16 rounds, as a text changes
within a sequence) joined, worth four drafts, by position j's rate over every text so far (an
optimistic 0.8 worth two rounds before any, so that drafting looks worth trying; halved every
256 rounds) moved toward the rate this text gave at the positions above j. Texts differ far
more than positions of one text do: a text the draft takes whole and one it mostly misses
follow each other, and what other texts showed of a position the new one has not reached
misleads more than the new one's first rounds. A round's acceptance is told as soon as its
verdict is known, and after a draft's verdict K* is planned again before the next K is chosen
(a tree round tells the chain inside it: that keeps the chain's expected rate, which a tree
must beat, current while trees run); what the round cost comes a round later. w(K) is the
card's wait for a draft of K: the median of its last 8 waits for K where K was drafted at least
twice, else a line through those medians (the round trip and the drafting a token; near the
round trip alone when prefetch answers at once); c + v(K + 1) is the host's and the target's
time in a round verifying K + 1 tokens: the moving average of such rounds where there were at
least two, else c plus a least-squares line through the verify averages of the n that were
seen (a target's cost is not a line in n: onnxruntime and BLAS pick kernels by shape, so what
was measured is used as measured).

What the formula cannot see, the rounds show. Once steady rounds of a K (following a round at
the same K, so that the card drafted ahead for it) have been seen whole four times within the
last 64 rounds, the tokens per second they really gave, card wait included, replace the formula
for that K: prefetch hits and misses, and first runs of a shape, count as they happen. The
formula ranks the K not measured lately as it stands (scaling it by how far it was off for the K
measured most took the error of a long draft's deep positions to the short drafts, and sent
the policy to K = 0 on text where K = 4 paid).

Exploration: every 8th round K*+1, so that positions beyond K* keep being measured; four rounds
later two rounds at K = 0 while the target alone has not been measured in the last 64 rounds
and drafting does not already promise twice its rate (it is the baseline every other K must
beat; only the second round counts, as the card may still be drafting ahead beside the first,
and on this kind of machine card and target share the last-level cache). No round explores
K*-1: its positions are measured in every round at K*, and the card, having drafted ahead K*-1
tokens, would make the round after it wait for a draft of K* made anew; replayed over 16 texts
of the demo pair at the large target's costs (``exstill-bench policy``) dropping it gained 3%
(the geometric mean over texts of the policy over each text's best fixed K: 0.897 to 0.925).

A new sequence is a new text: its counts start empty, and the tokens per second measured at
each drafting K are forgotten (they were the last text's); what a pass costs, the card's wait
a token and the target alone's rate are the machine's and stay.

K* = 0 means drafting does not pay at these costs: the round is the target's plain step with no
card round at all (the decoder brings the card up to date when K* turns positive again). Such a
policy probes K = 1 after 32 rounds, then after 64, 128, up to 1024 while probes keep confirming
K* = 0, and leaves K = 0 only for a K that promises 15% more than the target alone: each switch
costs the card a catch-up that the rates do not count, and without the margin text that is
briefly easy to draft makes K* flip between 0 and 2 at a loss. K* is recomputed every round
(a text the draft takes whole gets its long drafts in the few rounds a sequence may have), every
16th while it is 0.

Pure Python on purpose: this runs every round, and on a target whose step costs a few hundred
microseconds, numpy's per-call overhead on arrays of nine numbers would be a visible share.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

from exstill_sdk.speculative.estimators import Line, MovingAverage, PositionAcceptance, fit_line

PRIOR = 0.8
PRIOR_WEIGHT = 2.0
MIN_SAMPLES = 2
"""Verify samples of one n before their mean replaces the line."""
VERIFY_WINDOW = 16
"""The verify averages weigh about the last 16 rounds of each n."""
MEASURED_ROUNDS = 4
"""Whole rounds of a K (its card wait, verification and host time) after which the tokens per
second they gave replace the model's estimate for that K."""
STALE_ROUNDS = 64
"""A whole-round measurement older than this many rounds no longer counts (the target's step
changes as its context grows); the target alone is then measured again."""
CLEAR_WIN = 2.0
"""Drafting that gives this many times the target alone's tokens per second needs no re-check of
the target alone."""
SWITCH_MARGIN = 0.15
"""At K* = 0, drafting must promise this much more than the target alone before the stream
drafts again: each switch costs the card a catch-up that the rates above do not count."""
TEXT_WEIGHT = 4.0
"""A position's counts in this text weigh against what every text and this text's positions
above it give (``PositionAcceptance.rates_given``) as if that were this many drafts. At 2, the
draft missing a text's first tokens in two or three rounds sent the policy to K = 0, where
probes come only every 32 rounds and more: replayed over 51 texts of the demo pair at the large
target's costs (``exstill-bench policy``), the geometric mean of the policy over each text's
best fixed K rose from 0.879 and 0.926 (two sets of texts) to 0.940 and 0.936 at 4 (at 6:
0.930 and 0.937; at 8: 0.934 and 0.939)."""
ACCEPTANCE_HALF_LIFE = 256
"""Every this many rounds the acceptance counts are halved, so that a long-lived policy follows
the text it now drafts for (and, at K = 0, what a probe sees soon counts)."""


CARD_WAIT_SAMPLES = 8
"""The card's wait for a draft of K is the median of the last this many waits for one: one
stall (a first run of a shape on the emulated card, a busy link) took 37 ms for a draft of one
token, and the moving average of waits a token that it lifted to 7.6 ms kept the policy at
K = 0 for good, since rounds of the target alone and probes (catch-ups) never tell it the
card's drafting again."""


PLAIN_BURST = 16
"""Most rounds of the target alone the decoder runs between two choices of K."""


class ChainRound(NamedTuple):
    """A steady chain round at some K, as a policy's plan sees it."""

    tokens: float
    """Tokens it is expected to give in the text at hand."""
    seconds: float
    """What it takes: the host's share, the target's pass and the card's answer."""


class KPolicy:
    """What the decoder asks of a K policy; measurements are ignored unless overridden."""

    def choose(self, max_k: int) -> int:
        raise NotImplementedError

    def plain_rounds(self) -> int:
        """How many next rounds are sure to be at K = 0 (the decoder runs them as one burst)."""
        return 0

    def observe_acceptance(self, k: int, accepted: int) -> None:
        """A round drafted ``k`` tokens and the target accepted the first ``accepted``: told as
        soon as the verdict is known, before the next K is chosen (what the round cost comes a
        round later, with ``observe``)."""

    def observe(
        self,
        k: int,
        accepted: int,
        verify_s: float,
        other_s: float,
        next_k: int,
        card_wait_s: float,
    ) -> None:
        """A round verified ``k`` drafted tokens and accepted ``accepted``; then the card took
        ``card_wait_s`` to answer for the next ``next_k`` (0: not asked, or not a round's cost,
        as when the card first had to catch up with rounds it was not asked in)."""

    def observe_plain(self, rounds: int, verify_s: float, other_s: float) -> None:
        """``rounds`` rounds at K = 0 (the target alone), with their mean times."""

    def expected_rate(self) -> float | None:
        """Tokens a second the policy expects of rounds at the K it would settle on; None
        where it does not know (a fixed K learns nothing)."""
        return None

    def start_sequence(self) -> None:
        """A new sequence begins (its text is not the last one's)."""

    def verify_seconds(self, n: int) -> float | None:
        """Seconds the target takes to verify ``n`` tokens of one sequence, as the policy has
        measured or modelled it (any n: beyond the longest chain, the line's); None where it
        does not know."""
        return None

    def chain_rounds(self) -> Sequence[ChainRound] | None:
        """Its last plan's steady chain round at each K = 0 .. max_k: the tokens it expects
        one to give in this text and the seconds one takes; None before a plan (a fixed K
        makes none)."""
        return None


class FixedK(KPolicy):
    def __init__(self, k: int) -> None:
        self.k = k

    def choose(self, max_k: int) -> int:
        return min(self.k, max_k)

    def plain_rounds(self) -> int:
        return 0 if self.k else PLAIN_BURST


class AdaptiveK(KPolicy):
    EXPLORE_EVERY = 8
    IDLE_PROBE_FIRST = 32
    IDLE_PROBE_MAX = 1024
    REPLAN_EVERY = 1
    TEXT_HALF_LIFE = 16
    """Every this many rounds' verdicts (a tree's and the target alone's included) this text's
    counts are halved: a text changes within a sequence (a hard stretch, then one the draft
    takes whole)."""
    IDLE_REPLAN_EVERY = 16

    def __init__(self, max_k: int = 8, initial: int | None = None) -> None:
        self.max_k = max_k
        # With nothing measured yet the prior (acceptance 0.8 everywhere) and unknown costs
        # favour the longest draft; measurements bring K down when the draft is poor.
        self.initial = max_k if initial is None else min(initial, max_k)
        self.acceptance = PositionAcceptance(max_k)
        """Every text's counts: what the draft does in general."""
        self.text = PositionAcceptance(max_k)
        """This sequence's counts."""
        self._verify = [MovingAverage(VERIFY_WINDOW) for _ in range(max_k + 2)]
        """Per n = tokens verified: the target's seconds."""
        self._verify_fn: Callable[[int], float] | None = None
        """``_verify_model``'s function, made again after a new verify sample."""
        self._round = [MovingAverage(VERIFY_WINDOW) for _ in range(max_k + 1)]
        """Per K: verify + host seconds of its rounds (counted with ``_verify[K + 1]``)."""
        self._done_tokens = [MovingAverage(VERIFY_WINDOW) for _ in range(max_k + 1)]
        self._done_seconds = [MovingAverage(VERIFY_WINDOW) for _ in range(max_k + 1)]
        """Per K: rounds measured whole (card wait too), their tokens and seconds."""
        self._wait: tuple[int, float] | None = None  # the card wait of the next round's draft
        self._done_at = [0] * (max_k + 1)  # per K: the round it was last measured whole
        self._rates = [0.0] * (max_k + 1)  # the last plan's tokens per second, by K
        self._outlook: list[ChainRound] = []  # the last plan's rounds, by K
        self._last_k = -1
        self._card_waits = [deque[float](maxlen=CARD_WAIT_SAMPLES) for _ in range(max_k + 1)]
        """Per K: the card's latest waits for a draft of K."""
        self._card_wait = [0.0] * (max_k + 1)
        """Per K: the median of ``_card_waits[K]``."""
        self._card_wait_fn: Callable[[int], float] | None = None
        """``_card_wait_model``'s function, made again after a new wait."""
        self.other = 0.0
        self.rounds = 0
        self._best = -1
        self._planned_at = 0
        self._verdicts = 0
        """Rounds' verdicts told (``observe_acceptance``) in this sequence."""
        self._told_since_plan = False
        """A draft's verdict (K > 0) was told since K* was last planned, timed or not."""
        self._idle_rounds = 0
        self._idle_probe_every = self.IDLE_PROBE_FIRST

    def observe(
        self,
        k: int,
        accepted: int,
        verify_s: float,
        other_s: float,
        next_k: int,
        card_wait_s: float,
    ) -> None:
        self.rounds += 1
        if self.rounds % ACCEPTANCE_HALF_LIFE == 0:
            self.acceptance.halve()
        if k or self._last_k == 0:
            # (a first round of the target alone shares the machine with the card's drafting
            # ahead: on the small demo target it took 3 plain steps, and counted it made
            # drafting look worth it on text where it lost)
            self._verify[k + 1].update(verify_s)
            self._verify_fn = None
            self._round[k].update(verify_s + other_s)
        if not k:
            if self._last_k == 0:  # the card idle since the round before: no draft beside it
                self._done(0, 1.0, verify_s + other_s)
        elif self._wait is not None and self._wait[0] == k and self._last_k == k:
            # a steady round: the card drafted ahead for this K (a first round at a new K
            # finds no draft ahead of that length, which says nothing of staying at it)
            self._done(k, accepted + 1.0, self._wait[1] + verify_s + other_s)
        self._wait = (next_k, card_wait_s) if next_k else None
        self._last_k = k
        if next_k:
            waits = self._card_waits[next_k]
            waits.append(card_wait_s)
            self._card_wait[next_k] = statistics.median(waits)
            self._card_wait_fn = None
        self.other += 0.2 * (other_s - self.other)

    def observe_acceptance(self, k: int, accepted: int) -> None:
        self._verdicts += 1  # the target alone's rounds too: the text moves on under them
        if self._verdicts % self.TEXT_HALF_LIFE == 0:
            self.text.halve()
        if k > 0:  # a round of the target alone tells nothing of acceptance: no plan on it
            self.acceptance.observe(k, accepted)
            self.text.observe(k, accepted)
            self._told_since_plan = True

    def _done(self, k: int, tokens: float, seconds: float, rounds: int = 1) -> None:
        """A whole round at K (``rounds`` of them, averaged): what it yielded and cost."""
        self._done_at[k] = self.rounds
        self._done_tokens[k].update(tokens, rounds)
        self._done_seconds[k].update(seconds, rounds)

    def observe_plain(self, rounds: int, verify_s: float, other_s: float) -> None:
        self._done(0, 1.0, verify_s + other_s, rounds)
        self._wait, self._last_k = None, 0
        if self.rounds // ACCEPTANCE_HALF_LIFE != (self.rounds + rounds) // ACCEPTANCE_HALF_LIFE:
            self.acceptance.halve()
        self.rounds += rounds
        self._idle_rounds += rounds
        self._verify[1].update(verify_s, rounds)
        self._verify_fn = None
        self._round[0].update(verify_s + other_s, rounds)
        self.other += min(1.0, 0.2 * rounds) * (other_s - self.other)

    def plain_rounds(self) -> int:
        """Up to the next probe or replan."""
        if self._best != 0:
            return 0
        replan = self.IDLE_REPLAN_EVERY - (self.rounds - self._planned_at)
        probe = self._idle_probe_every - self._idle_rounds - 1
        return max(0, min(replan, probe, PLAIN_BURST))

    def _verify_model(self) -> Callable[[int], float]:
        """Seconds to verify n tokens, as the docstring says (measured, else the line); made
        once per new verify sample (the shape chooser asks every round)."""
        if self._verify_fn is None:
            seen = [(n, a) for n, a in enumerate(self._verify) if n and a.count]
            points = [(n, a.value) for n, a in seen if a.count >= MIN_SAMPLES] or [
                (n, a.value) for n, a in seen
            ]
            line = fit_line((n, y, 1.0) for n, y in points)
            measured = dict(points)
            self._verify_fn = lambda n: measured.get(n, max(line(n), 1e-9))
        return self._verify_fn

    def _card_wait_model(self) -> Callable[[int], float]:
        """Seconds the card takes to answer for a draft of K: the median of its waits for K
        where there were at least two, else the line through those medians (its intercept the
        round trip, its slope the drafting a token); a draft of one K seen: in proportion to
        K. Made once per new wait."""
        if self._card_wait_fn is None:
            counts = [len(w) for w in self._card_waits]
            points = [(k, self._card_wait[k], n) for k, n in enumerate(counts) if n]
            many = [p for p in points if p[2] >= MIN_SAMPLES] or points
            if len(many) > 1:  # one point a K
                line = fit_line((k, y, float(n)) for k, y, n in many)
            else:  # one K: nothing tells the round trip from the drafting
                line = Line(0.0, many[0][1] / many[0][0] if many else 0.0)
            measured = {k: y for k, y, n in many if n >= MIN_SAMPLES}
            self._card_wait_fn = lambda k: measured.get(k, max(line(k), 0.0))
        return self._card_wait_fn

    def verify_times(self) -> list[float]:
        """Seconds to verify n = 1 .. max_k + 1 tokens (index n - 1)."""
        verify = self._verify_model()
        return [verify(n) for n in range(1, self.max_k + 2)]

    def verify_seconds(self, n: int) -> float | None:
        if not any(a.count for a in self._verify):
            return None
        return self._verify_model()(n)

    def round_times(self) -> list[float]:
        """c + v(K + 1) for K = 0 .. max_k: measured where rounds of that K were seen at least
        twice (what the target and the host really spent on them), else from the model."""
        verify = self.verify_times()
        return [
            self._round[k].value if self._round[k].count >= MIN_SAMPLES else self.other + verify[k]
            for k in range(self.max_k + 1)
        ]

    def _round_seconds(self) -> list[float]:
        """A steady round at K = 0 .. max_k: c + v(K + 1) + w(K) (no card at K = 0)."""
        card_wait = self._card_wait_model()
        return [t + (card_wait(k) if k else 0.0) for k, t in enumerate(self.round_times())]

    def chain_rounds(self) -> Sequence[ChainRound] | None:
        return self._outlook if self._best >= 0 and self._outlook else None

    def _measured_rate(self, k: int) -> float:
        """Tokens per second that rounds at K really gave, once seen often enough and lately;
        else 0."""
        done = self._done_tokens[k]
        if done.count < MEASURED_ROUNDS or self.rounds - self._done_at[k] > STALE_ROUNDS:
            return 0.0
        return done.value / self._done_seconds[k].value

    def _plan(self) -> int:
        """K* over 0..max_k, as the module docstring says."""
        times = self._round_seconds()
        outlook = [ChainRound(1.0, times[0])]
        rates = [self._measured_rate(0) or 1.0 / times[0]]
        best, best_rate = 0, rates[0]
        if self._best == 0:  # leaving K = 0 costs the card a catch-up: it must pay clearly
            best_rate *= 1 + SWITCH_MARGIN
        expected, run = 1.0, 1.0
        pooled = self.acceptance.rates(PRIOR, PRIOR_WEIGHT)
        for k, a in enumerate(self.text.rates_given(pooled, TEXT_WEIGHT), 1):
            run *= a
            expected += run
            outlook.append(ChainRound(expected, times[k]))
            rates.append(self._measured_rate(k) or expected / times[k])
            if rates[k] > best_rate:
                best, best_rate = k, rates[k]
        self._rates, self._outlook = rates, outlook
        return best

    def start_sequence(self) -> None:
        self.text = PositionAcceptance(self.max_k)
        self._verdicts, self._told_since_plan = 0, False
        for k in range(1, self.max_k + 1):
            self._done_tokens[k] = MovingAverage(VERIFY_WINDOW)
            self._done_seconds[k] = MovingAverage(VERIFY_WINDOW)
        if self._best > 0:
            self._best = -1  # plan again at the next choice

    def expected_rate(self) -> float | None:
        return max(self._rates) if self._best >= 0 and max(self._rates) > 0 else None

    def _target_alone_in_doubt(self, best: int) -> bool:
        """Whether rounds of the target alone should be measured (again): drafting does not
        already give twice their estimated rate, and they were not measured lately."""
        fresh = self._done_tokens[0].count >= MEASURED_ROUNDS
        fresh = fresh and self.rounds - self._done_at[0] <= STALE_ROUNDS
        return not fresh and self._rates[best] < CLEAR_WIN * self._rates[0]

    def choose(self, max_k: int) -> int:
        max_k = min(max_k, self.max_k)
        if max_k <= 0:
            return 0
        if self.rounds < 2 or sum(a.count for a in self._verify) < 2:  # no verify cost yet
            return min(self.initial, max_k)
        every = self.REPLAN_EVERY if self._best else self.IDLE_REPLAN_EVERY
        if self._best < 0 or self._told_since_plan or self.rounds - self._planned_at >= every:
            self._best, self._planned_at = self._plan(), self.rounds
            self._told_since_plan = False
        best = min(self._best, max_k)
        if best == 0:
            self._idle_rounds += 1
            if self._idle_rounds < self._idle_probe_every:
                return 0
            self._idle_rounds = 0
            self._idle_probe_every = min(2 * self._idle_probe_every, self.IDLE_PROBE_MAX)
            return 1
        self._idle_rounds, self._idle_probe_every = 0, self.IDLE_PROBE_FIRST
        phase = self.rounds % self.EXPLORE_EVERY
        if phase == 0:
            return min(best + 1, max_k)
        half = self.EXPLORE_EVERY // 2
        if phase in (half, half + 1) and self._target_alone_in_doubt(best):
            # two rounds of the target alone: the second is measured, with the card quiet
            for done in (self._done_tokens[0], self._done_seconds[0]):  # weigh new ones more
                done.count = min(done.count, MEASURED_ROUNDS)
            return 0
        return best
