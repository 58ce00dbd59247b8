"""K for every sequence of a batch, chosen together from what a verification pass costs.

With several sequences verified in one pass over the target's weights (``verify_batch``), a
round's cost is the pass's: a function of the tokens in it, T = sum over sequences of K + 1,
not of any one sequence's K. On a target bound by reading its weights the pass costs about the
same from 1 to a few tokens and then grows with T once arithmetic bounds it; so the best K
depends on how many sequences share the pass, down to K = 0 for all when plain batching
already fills it.

The choice, from measurements:

    gain(i, j)  = prod_{l=1..j} a(i, l)          (drafted token j of sequence i is emitted)
    rate(m)     = (B + top m gains) / (pass(B + m) + other(m))
    m*          = the least m with rate(m) within 3% of the best; sequence i drafts as many
                  tokens as it has in the top m*

a(i, l) is sequence i's measured acceptance at position l given all before it were accepted:
its own counts, halved every 32 passes, joined, worth four drafts, by the batch's pooled rate
at l moved toward the rate sequence i gave at the positions above l (``rates_given``, as
adaptive K reads one text: a sequence whose drafts were all kept is expected to go on past
them, whatever other texts showed there); the pooled rate has a prior of 0.8 worth two rounds,
so positions not tried look worth trying. A sequence's gains fall with j, so the top m is
always a prefix per sequence. Near the best, the estimated rate is flat over a wide range of
m, and what the estimates miss (the card's drafting ahead, acceptance that drifts) costs long
drafts more than short ones: hence the least drafting among plans within 3% of the best.

``pass(T)`` is the measured cost of a pass of T tokens (``PassCost``: the averages per T,
made non-decreasing and joined by lines; until two sizes are measured, proportional to T,
which starts drafting short); ``other(m)`` the rest of a round (acceptance, the
card's replies, the host): a least-squares line by the tokens the card drafts in it (a draft
ahead that missed is drafted again while the host waits), from rounds that only committed.

Exploration: every 16th pass m* + step, eight passes later m* - step (step = the largest
of 1, B / 2 and m* / 2), and every 32nd pass K = 0 for all, starting with the second pass
measured, so that the curve spans the plain pass and the sizes around m* early. The plan is
redone every pass: it is a sort of at most B * max_k numbers.
"""

from __future__ import annotations

from bisect import bisect_left

from exstill_sdk.speculative.estimators import Line, MovingAverage, PositionAcceptance, fit_line
from exstill_sdk.speculative.timing import PassTiming

PRIOR = 0.8
PRIOR_WEIGHT = 2.0
POOLED_WEIGHT = 4.0
"""A sequence's own counts weigh against the batch's pooled rate (moved toward the sequence's
rate above each position) as if it were this many drafts."""
WINDOW = 16
"""Pass and round averages weigh about the last 16 of each."""
HALF_LIFE = 256
"""Every this many passes the pooled acceptance counts are halved: the policy follows the
text."""
SEQUENCE_HALF_LIFE = 32
"""A sequence's own counts are halved every this many passes: its text changes within a
request, and its K should follow."""
TIE = 0.03
"""Plans whose estimated rates are within this fraction of the best count as tied."""
EXPLORE_EVERY = 16
PLAIN_EVERY = 32


class LineCost:
    """Seconds something takes by how many tokens it handles: the moving averages per size,
    and a least-squares line through them (weighted by their samples, a slope of at least 0,
    flat while one size is measured) for every size."""

    def __init__(self) -> None:
        self._mean: dict[int, MovingAverage] = {}
        self._line: Line | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        average = self._mean.get(tokens)
        if average is None:
            average = self._mean[tokens] = MovingAverage(WINDOW)
        average.update(seconds)
        self._line = None

    def _points(self) -> list[tuple[int, float, int]]:
        return [(t, a.value, min(a.count, WINDOW)) for t, a in self._mean.items()]

    def __call__(self, tokens: int) -> float:
        if not self._mean:
            return 0.0
        if self._line is None:
            self._line = fit_line(self._points())
        return max(0.0, self._line(tokens))


class PassCost(LineCost):
    """Seconds a verification pass takes by the tokens in it: the moving averages per size,
    made non-decreasing in size (pool-adjacent-violators: more tokens never cost less, so a
    noisy average that says so is pooled with its neighbour) and joined by straight lines;
    beyond the largest size measured, the slope of the least-squares line through them all.
    On a target whose pass turns from bound by memory to bound by arithmetic this keeps the
    turn that one line through every size would smooth away."""

    def __init__(self) -> None:
        super().__init__()
        self._knots: list[tuple[float, float]] = []
        self._slope = 0.0

    def __call__(self, tokens: int) -> float:
        if len(self._mean) < 2:  # until two sizes are known: as if every token cost the same
            t, y = next(((t, a.value) for t, a in self._mean.items()), (1, 1.0))
            return y * tokens / t
        if self._line is None:
            self._line = fit_line(self._points())
            self._slope = self._line.slope
            self._knots = self._fit()
        knots = self._knots
        if tokens <= knots[0][0]:
            return knots[0][1]
        last_t, last_y = knots[-1]
        if tokens >= last_t:
            return last_y + self._slope * (tokens - last_t)
        hi = bisect_left(knots, (tokens, -1.0))
        (t0, y0), (t1, y1) = knots[hi - 1], knots[hi]
        return y0 + (y1 - y0) * (tokens - t0) / (t1 - t0)

    def _fit(self) -> list[tuple[float, float]]:
        blocks: list[list[float]] = []  # [weight, weighted size, weighted seconds]
        for t, y, count in sorted(self._points()):
            w = float(count)
            blocks.append([w, w * t, w * y])
            while len(blocks) > 1 and blocks[-2][2] / blocks[-2][0] > blocks[-1][2] / blocks[-1][0]:
                w2, t2, y2 = blocks.pop()
                blocks[-1][0] += w2
                blocks[-1][1] += t2
                blocks[-1][2] += y2
        return [(t / w, y / w) for w, t, y in blocks]


class BatchK:
    """The K of every sequence in a batch (module docstring)."""

    def __init__(self, max_k: int = 8) -> None:
        self.max_k = max_k
        self.cost = PassCost()
        self.other = LineCost()
        """Seconds of a round outside its pass (acceptance, the card's replies, the host), by
        the tokens drafted for the next round: the card drafts them again when a draft ahead
        missed."""
        self._acceptance: dict[int, PositionAcceptance] = {}
        """Each sequence's own counts."""
        self.pooled = PositionAcceptance(max_k)
        self.passes = 0

    # ------------------------------------------------------------------ measurements

    def observe_round(self, seq: int, k: int, accepted: int, timed: bool = True) -> None:
        """Sequence ``seq`` drafted ``k`` tokens and ``accepted`` of them were accepted (its
        costs come with the pass, ``timed`` or not)."""
        own = self._acceptance.get(seq)
        if own is None:
            own = self._acceptance[seq] = PositionAcceptance(self.max_k)
        own.observe(k, accepted)
        self.pooled.observe(k, accepted)

    def observe_pass(self, timing: PassTiming) -> None:
        """A pass and the round before it: the pass's cost by its tokens, and the round's by
        the tokens the card drafted in it (not a round that also brought a stream up to date,
        which is not what drafting costs). Passes that held a prompt, and passes whose round is
        unknown, are not counted."""
        if not timing.steady or timing.round_s is None:
            return
        self.cost.observe(timing.tokens, timing.pass_s)
        if timing.drafted is not None:
            self.other.observe(timing.drafted, timing.round_s)
        self.passes += 1
        if self.passes % SEQUENCE_HALF_LIFE == 0:
            for own in self._acceptance.values():
                own.halve()
        if self.passes % HALF_LIFE == 0:
            self.pooled.halve()

    def forget(self, seq: int) -> None:
        """The sequence finished."""
        self._acceptance.pop(seq, None)

    # ------------------------------------------------------------------ the choice

    def acceptance(self, seq: int) -> list[float]:
        """a(seq, l) for l = 1..max_k (index l - 1)."""
        return self._acceptance_given(seq, self.pooled.rates(PRIOR, PRIOR_WEIGHT))

    def _acceptance_given(self, seq: int, pooled: list[float]) -> list[float]:
        """a(seq, l) given the pooled rates (worked out once a pass, not once a sequence)."""
        own = self._acceptance.get(seq)
        return pooled if own is None else own.rates_given(pooled, POOLED_WEIGHT)

    def _gains(self, seqs: list[int], limits: list[int]) -> list[tuple[float, int]]:
        """(gain, index in seqs) of every token the sequences could draft, best first."""
        gains: list[tuple[float, int]] = []
        pooled = self.pooled.rates(PRIOR, PRIOR_WEIGHT)
        for i, (seq, limit) in enumerate(zip(seqs, limits, strict=True)):
            run = 1.0
            for a in self._acceptance_given(seq, pooled)[:limit]:
                run *= a
                gains.append((run, i))
        gains.sort(key=lambda g: -g[0])
        return gains

    def plan(self, seqs: list[int], limits: list[int]) -> tuple[list[int], float]:
        """K per sequence maximising the batch's emitted tokens per second, and that rate."""
        b = len(seqs)
        other = self.other
        gains = self._gains(seqs, limits)
        rates = [b / (self.cost(b) + other(0))]
        total = float(b)
        for m, (gain, _) in enumerate(gains, 1):
            total += gain
            rates.append(total / (self.cost(b + m) + other(m)))
        best_rate = max(rates)
        # the least drafting within TIE of the best: what the estimates miss (the card's
        # drafting ahead, acceptance that drifts) costs long drafts more than short ones
        m = next(m for m, rate in enumerate(rates) if rate >= best_rate * (1 - TIE))
        return self._take(gains, m, b), rates[m]

    @staticmethod
    def _take(gains: list[tuple[float, int]], m: int, b: int) -> list[int]:
        ks = [0] * b
        for _, i in gains[:m]:
            ks[i] += 1
        return ks

    def choose(self, seqs: list[int], limits: list[int]) -> list[int]:
        """K for each of ``seqs`` (at most its limit), with the exploration of the docstring."""
        ks, _ = self.plan(seqs, limits)
        phase = self.passes % PLAIN_EVERY
        if phase == 1:
            ks = [0] * len(ks)
        elif phase % EXPLORE_EVERY in (3, 3 + EXPLORE_EVERY // 2):
            m = sum(ks)
            step = max(1, len(seqs) // 2, m // 2)
            m += step if phase % EXPLORE_EVERY == 3 else -step
            ks = self._explore(seqs, limits, max(0, m))
        return ks

    def _explore(self, seqs: list[int], limits: list[int], m: int) -> list[int]:
        return self._take(self._gains(seqs, limits), m, len(seqs))
