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

a(i, l) is sequence i's measured acceptance at position l given all before it were accepted
(its own counts, halved every 32 passes, with the batch's pooled rate worth four rounds as a
prior; the pooled rate with a prior of 0.8 worth two rounds, so positions not tried look worth
trying); a sequence's gains fall with j, so the top m is always a prefix per sequence. Near the
best, the estimated rate is flat over a wide range of m, and what the estimates miss (the
card's drafting ahead, acceptance that drifts) costs long drafts more than short ones: hence
the least drafting among plans within 3% of the best.

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

PRIOR = 0.8
PRIOR_WEIGHT = 2.0
POOLED_WEIGHT = 4.0
"""A sequence's own counts weigh against the batch's pooled rate as if it were this many rounds."""
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
        self._mean: dict[int, float] = {}
        self._count: dict[int, int] = {}
        self._line: tuple[float, float] | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        count = self._count[tokens] = self._count.get(tokens, 0) + 1
        mean = self._mean.get(tokens, seconds)
        self._mean[tokens] = mean + (seconds - mean) / min(count, WINDOW)
        self._line = None

    @property
    def measured(self) -> dict[int, float]:
        return dict(self._mean)

    def _points(self) -> list[tuple[int, float, int]]:
        return [(t, y, min(self._count[t], WINDOW)) for t, y in self._mean.items()]

    def __call__(self, tokens: int) -> float:
        if not self._mean:
            return 0.0
        if self._line is None:
            self._line = _line(self._points())
        intercept, slope = self._line
        return max(0.0, intercept + slope * tokens)


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
            t, y = next(iter(self._mean.items()), (1, 1.0))
            return y * tokens / t
        if self._line is None:
            self._line = _line(self._points())
            self._slope = self._line[1]
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
        for t in sorted(self._mean):
            w = float(min(self._count[t], WINDOW))
            blocks.append([w, w * t, w * self._mean[t]])
            while len(blocks) > 1 and blocks[-2][2] / blocks[-2][0] > blocks[-1][2] / blocks[-1][0]:
                w2, t2, y2 = blocks.pop()
                blocks[-1][0] += w2
                blocks[-1][1] += t2
                blocks[-1][2] += y2
        return [(t / w, y / w) for w, t, y in blocks]


def _line(points: list[tuple[int, float, int]]) -> tuple[float, float]:
    """Intercept and slope (at least 0) of the weighted least-squares line through
    (x, y, weight); flat through their mean with fewer than two sizes."""
    total = sum(w for _, _, w in points)
    mx = sum(t * w for t, _, w in points) / total
    my = sum(y * w for _, y, w in points) / total
    spread = sum(w * (t - mx) ** 2 for t, _, w in points)
    if len(points) < 2 or not spread:
        return my, 0.0
    slope = max(0.0, sum(w * (t - mx) * (y - my) for t, y, w in points) / spread)
    return my - slope * mx, slope


class BatchK:
    """The K of every sequence in a batch (module docstring)."""

    def __init__(self, max_k: int = 8) -> None:
        self.max_k = max_k
        self.cost = PassCost()
        self.other = LineCost()
        """Seconds of a round outside its pass (acceptance, the card's replies, the host), by
        the tokens drafted for the next round: the card drafts them again when a draft ahead
        missed."""
        self._reached: dict[int, list[float]] = {}
        self._accepted: dict[int, list[float]] = {}
        self.pooled_reached = [0.0] * (max_k + 1)
        self.pooled_accepted = [0.0] * (max_k + 1)
        self.passes = 0
        self.last_plan: list[int] = []

    # ------------------------------------------------------------------ measurements

    def observe_round(self, seq: int, k: int, accepted: int) -> None:
        """Sequence ``seq`` drafted ``k`` tokens and ``accepted`` of them were accepted."""
        reached = self._reached.setdefault(seq, [0.0] * (self.max_k + 1))
        hits = self._accepted.setdefault(seq, [0.0] * (self.max_k + 1))
        for j in range(1, min(k, accepted + 1) + 1):  # reached: all before it were accepted
            ok = j <= accepted
            reached[j] += 1
            hits[j] += ok
            self.pooled_reached[j] += 1
            self.pooled_accepted[j] += ok

    def observe_pass(self, tokens: int, seconds: float, drafted: int | None, other: float) -> None:
        """A pass of ``tokens`` tokens took ``seconds``; the rest of its round, in which the
        card drafted ``drafted`` tokens for the next, took ``other`` (None: a round that also
        brought a stream up to date, which is not what drafting costs)."""
        self.cost.observe(tokens, seconds)
        if drafted is not None:
            self.other.observe(drafted, other)
        self.passes += 1
        if self.passes % SEQUENCE_HALF_LIFE == 0:
            for counts in (*self._reached.values(), *self._accepted.values()):
                counts[:] = [c / 2 for c in counts]
        if self.passes % HALF_LIFE == 0:
            self.pooled_reached = [c / 2 for c in self.pooled_reached]
            self.pooled_accepted = [c / 2 for c in self.pooled_accepted]

    def forget(self, seq: int) -> None:
        """The sequence finished."""
        self._reached.pop(seq, None)
        self._accepted.pop(seq, None)

    # ------------------------------------------------------------------ the choice

    def acceptance(self, seq: int) -> list[float]:
        """a(seq, l) for l = 1..max_k (index l - 1)."""
        reached = self._reached.get(seq)
        hits = self._accepted.get(seq)
        out = []
        for j in range(1, self.max_k + 1):
            pooled = (self.pooled_accepted[j] + PRIOR * PRIOR_WEIGHT) / (
                self.pooled_reached[j] + PRIOR_WEIGHT
            )
            if reached is None or hits is None:
                out.append(pooled)
            else:
                out.append((hits[j] + pooled * POOLED_WEIGHT) / (reached[j] + POOLED_WEIGHT))
        return out

    def _gains(self, seqs: list[int], limits: list[int]) -> list[tuple[float, int]]:
        """(gain, index in seqs) of every token the sequences could draft, best first."""
        gains: list[tuple[float, int]] = []
        for i, (seq, limit) in enumerate(zip(seqs, limits, strict=True)):
            run = 1.0
            for a in self.acceptance(seq)[:limit]:
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
        self.last_plan = ks
        return ks

    def _explore(self, seqs: list[int], limits: list[int], m: int) -> list[int]:
        return self._take(self._gains(seqs, limits), m, len(seqs))
