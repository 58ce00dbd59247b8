"""Speculative against plain decoding of one target, timed like a card and read against what
the pair allows on this machine.

- Both paths are warmed first; then plain and speculative runs alternate (which goes first
  alternates too), and each figure is the median of the runs with their range. The speed-up is
  the median of the per-pair ratios.
- ``verify_curve``: what the target takes to score n tokens against one plain step; the pair's
  *limit* is the best over K of (tokens kept a pass at K) / (cost of scoring K+1 tokens in
  plain steps): the speed-up a free draft with this acceptance would give at the best fixed K.
  Efficiency is the measured speed-up over that limit.
- The tokens kept a pass at each K are the draft's own along the target's texts (the card's
  draft image run by onnxruntime, teacher-forced: evaluation/acceptance.py), exactly what a
  fixed-K decode of those texts keeps. Not the run's acceptance by position: with K chosen per
  round, the drafts that reach a late position are those the policy trusted, so acceptance
  there reads higher than a fixed K would see (on the 20M target 5.6 tokens a pass at K = 8,
  against 4.6 for a K = 8 decode of the same text).
- What a free draft would give if each round's K were chosen knowing its acceptance
  (``fastest_decode``): no chain draft passes that (``FreeDraft.oracle``).
- Figures that cannot be true are measured again or flagged (``SpeedupRun.warnings``): scoring
  several tokens timed as cheaper than one plain step (``curve_doubt``), which is then timed
  again up to ``CURVE_ATTEMPTS`` times, and a speed-up of chains above the free draft's
  oracle.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from exstill_sdk.evaluation.acceptance import fastest_decode, rounds, runs_from_matches
from exstill_sdk.evaluation.drafters import draft_ranks
from exstill_sdk.harness.passes import pass_seconds
from exstill_sdk.harness.timing import timed
from exstill_sdk.speculative.metrics import SpecMetrics

CHEAPEST_PASS = 0.8
"""Scoring n > 1 tokens costs at least this many plain steps: a pass reads every weight a plain
step reads. A verify curve below it was timed through the machine's noise."""
MOST_EFFICIENT = 1.05
"""A speed-up above the free draft's oracle by more than this factor means the verify cost is
wrong."""
CURVE_ATTEMPTS = 3


@dataclass(frozen=True)
class Spread:
    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        return cls(statistics.median(values), min(values), max(values))

    def to_dict(self, digits: int = 2) -> dict[str, float]:
        return {
            "median": round(self.median, digits),
            "min": round(self.low, digits),
            "max": round(self.high, digits),
        }


def verify_curve(
    target: Any, context: list[int], sizes: Sequence[int], repeats: int = 5
) -> dict[str, float]:
    """Microseconds the target takes to score n tokens after ``context`` (the median of
    ``repeats`` turns over the sizes): what a round of K drafted tokens costs the target
    (n = K + 1) against one plain step (n = 1). Speculation pays when this grows slowly
    with n."""
    samples = pass_seconds(target, [context], [n - 1 for n in sizes], turns=repeats, warmup=1)
    return {str(k + 1): round(statistics.median(v) * 1e6, 1) for k, v in samples.items()}


def curve_doubt(verify_us: dict[str, float]) -> str | None:
    """Why a verify curve cannot be true, or None: scoring n > 1 tokens timed cheaper than
    ``CHEAPEST_PASS`` plain steps."""
    step = verify_us["1"]
    cheap = [(n, us / step) for n, us in verify_us.items() if us < CHEAPEST_PASS * step]
    if not cheap:
        return None
    listed = ", ".join(f"{n} tokens {cost:.2f}" for n, cost in cheap)
    return (
        f"scoring several tokens timed cheaper than one plain step ({listed} steps): the "
        "machine was busy while the verify cost was timed, so the pair's limit and the "
        "efficiency are not to be trusted; run again when it is quiet"
    )


def limit_doubt(speedup: float, oracle: float) -> str | None:
    """Why a speed-up of chain drafts above the free draft's ``oracle`` (each round's K chosen
    knowing its acceptance) cannot be true, or None."""
    if speedup <= oracle * MOST_EFFICIENT:
        return None
    return (
        f"the speed-up {speedup:.2f}x is above {oracle:.2f}x, what a free draft choosing each "
        "round's K knowing its acceptance would give, which no draft of chains can pass: the "
        "verify cost was timed too high (a busy machine); run again when it is quiet"
    )


def pair_limit(taus: Sequence[float], verify_us: dict[str, float]) -> tuple[float, int]:
    """(the best speed-up a free draft could give at a fixed K, that K): the best over K of
    the tokens kept a pass at K (``taus[K - 1]``) over the cost of verifying K+1 tokens in
    plain steps; (1.0, 0) where no K gains."""
    step = verify_us["1"]
    best, best_k = 1.0, 0
    for k, tau in enumerate(taus, 1):
        if str(k + 1) not in verify_us:
            break
        ratio = tau / (verify_us[str(k + 1)] / step)
        if ratio > best:
            best, best_k = ratio, k
    return best, best_k


@dataclass(frozen=True)
class FreeDraft:
    """What a free, instant draft with the card's draft's acceptance along the target's texts
    would give (the module docstring)."""

    taus: tuple[float, ...]
    """Tokens kept a pass by a decode at fixed K = 1..max K."""
    limit: float
    limit_k: int
    oracle: float
    """The speed-up with each round's K chosen knowing its acceptance."""

    @classmethod
    def along(
        cls,
        draft: Any,
        prompts: Sequence[Sequence[int]],
        texts: Sequence[Sequence[int]],
        verify_us: dict[str, float],
        max_k: int,
    ) -> FreeDraft:
        """``draft`` (the card's draft image in a target adapter, ``demo.pair.draft_model``)
        teacher-forced along each prompt's ``texts``; the texts decoded one after another."""
        max_k = min(max_k, len(verify_us) - 1)
        costs = np.array([verify_us[str(k + 1)] for k in range(max_k + 1)]) / verify_us["1"]
        runs = [
            runs_from_matches(draft_ranks(draft, p, t) == 0, max_k)
            for p, t in zip(prompts, texts, strict=True)
            if t
        ]
        tokens = sum(len(r) for r in runs)
        if not tokens or not max_k:
            return cls((), 1.0, 0, 1.0)
        taus = tuple(tokens / sum(rounds(r, k).passes for r in runs) for k in range(1, max_k + 1))
        limit, limit_k = pair_limit(taus, verify_us)
        oracle = tokens / sum(fastest_decode(r, costs) for r in runs)
        return cls(taus, limit, limit_k, oracle)


@dataclass
class SpeedupRun:
    tokens: list[int]
    runs: int
    plain_tokens_per_s: Spread
    spec_tokens_per_s: Spread
    speedup: Spread
    identical: bool
    metrics: SpecMetrics
    verify_us: dict[str, float]
    free: FreeDraft
    warnings: tuple[str, ...] = ()
    """Figures that cannot be true, measured again and still so (module docstring)."""

    @property
    def limit(self) -> float:
        return self.free.limit

    @property
    def limit_k(self) -> int:
        return self.free.limit_k

    @property
    def efficiency(self) -> float:
        return self.speedup.median / self.limit

    @property
    def time_share(self) -> dict[str, float]:
        """Where the speculative runs' time went: the target verifying, waiting for the card,
        and the host's own work."""
        m = self.metrics
        total = m.card_wait_s + m.verify_s + m.host_s or 1.0
        return {
            "verify": round(m.verify_s / total, 3),
            "card_wait": round(m.card_wait_s / total, 3),
            "host": round(m.host_s / total, 3),
        }

    @property
    def verify_steps(self) -> dict[str, float]:
        return {n: round(us / self.verify_us["1"], 3) for n, us in self.verify_us.items()}

    def to_dict(self) -> dict[str, Any]:
        m = self.metrics
        return {
            "new_tokens": len(self.tokens),
            "runs": self.runs,
            "plain_tokens_per_s": self.plain_tokens_per_s.to_dict(1),
            "spec_tokens_per_s": self.spec_tokens_per_s.to_dict(1),
            "speedup": self.speedup.to_dict(),
            "identical": self.identical,
            "mean_acceptance_length": round(m.mean_acceptance_length, 3),
            "acceptance_per_position": [round(a, 3) for a in m.acceptance_per_position],
            "prefetch_hits": m.prefetch_hits,
            "rounds": m.rounds,
            "k_chosen": {str(k): v for k, v in sorted(m.k_chosen.items())},
            "tree_rounds": m.tree_rounds,
            "shapes_chosen": dict(m.shapes_chosen.most_common()),
            "time_share": self.time_share,
            "verify_us": self.verify_us,
            "verify_cost_steps": self.verify_steps,
            "limit": round(self.limit, 2),
            "limit_k": self.limit_k,
            "tokens_a_pass_at_k": {
                str(k): round(tau, 3) for k, tau in enumerate(self.free.taus, 1)
            },
            "oracle_limit": round(self.free.oracle, 2),
            "efficiency": round(self.efficiency, 3),
            "warnings": list(self.warnings),
        }


def measure_speedup(
    target: Any,
    decoder: Any,
    prompts: list[list[int]],
    new_tokens: int,
    *,
    draft: Any,
    runs: int = 3,
    on_token: Callable[[list[int]], None] | None = None,
    on_stage: Callable[[str], None] | None = None,
) -> SpeedupRun:
    """Plain greedy decoding (``target.greedy``) against ``decoder``'s speculative decoding of
    ``new_tokens`` after each of ``prompts`` (a run decodes them all, one after the other),
    ``runs`` of each way, alternating.

    A first speculative run of the first prompt warms the whole path (and, with ``on_token``,
    shows its tokens as the target accepts them); it is not timed. The decoder is one object
    throughout, as in a server: what its adaptive K learns of the target's and the card's
    costs carries over. ``draft``: the card's draft image in a target adapter
    (``demo.pair.draft_model``), for the pair's limit (``FreeDraft``). ``on_stage`` hears what
    is under way, as it starts."""
    stage = on_stage or (lambda _: None)
    first = prompts[0]
    stage("warming up: every verify shape once, then a first speculative run")
    warm = [*first, *target.greedy(first, 8)]
    step_s = verify_curve(target, warm, range(1, decoder.max_k + 2), repeats=1)["1"] / 1e6
    shown: list[int] = []
    started = time.perf_counter()
    for token in decoder.stream(first, new_tokens, stop_token_ids=[]):
        shown.append(token)
        if on_token is not None:
            on_token(shown)
    spec_estimate = (time.perf_counter() - started) * len(prompts)
    plain_estimate = step_s * new_tokens * len(prompts)
    estimate = runs * (spec_estimate + plain_estimate)
    stage(
        f"timing: {runs} run{'s' * (runs != 1)} of each way, alternating, about "
        f"{estimate:.{estimate < 10:d}f} s"
    )
    plain_s: list[float] = []
    spec_s: list[float] = []
    metrics = SpecMetrics(max_k=decoder.max_k)
    outputs: list[list[list[int]]] = []

    def plain() -> None:
        s, out = timed(lambda: [target.greedy(p, new_tokens) for p in prompts])
        plain_s.append(s)
        outputs.append(out)

    def speculative() -> None:
        s, results = timed(
            lambda: [decoder.generate(p, new_tokens, stop_token_ids=[]) for p in prompts]
        )
        spec_s.append(s)
        outputs.append([r.tokens for r in results])
        for r in results:
            metrics.merge(r.metrics)

    for i in range(runs):
        order: list[Callable[[], None]] = (
            [plain, speculative] if i % 2 == 0 else [speculative, plain]
        )
        for run in order:
            run()
    reference = outputs[0]
    identical = all(out == reference for out in outputs) and shown == reference[0]
    context = [*first, *reference[0][: new_tokens // 2]]
    stage(f"timing the verify cost: the target scoring 1..{metrics.max_k + 1} tokens in a pass")
    verify_us = verify_curve(target, context, range(1, metrics.max_k + 2))
    curve = curve_doubt(verify_us)
    for _ in range(CURVE_ATTEMPTS - 1):
        if curve is None:
            break
        verify_us = verify_curve(target, context, range(1, metrics.max_k + 2))
        curve = curve_doubt(verify_us)
    stage("scoring the target's texts with the draft, teacher-forced, for the pair's limit")
    free = FreeDraft.along(draft, prompts, reference, verify_us, metrics.max_k)
    produced = new_tokens * len(prompts)
    speedup = Spread.of([p / s for p, s in zip(plain_s, spec_s, strict=True)])
    # a tree keeps more than its chain's run: the chains' oracle does not bound it
    doubts = (curve, None if metrics.tree_rounds else limit_doubt(speedup.median, free.oracle))
    return SpeedupRun(
        tokens=shown,
        runs=runs,
        plain_tokens_per_s=Spread.of([produced / s for s in plain_s]),
        spec_tokens_per_s=Spread.of([produced / s for s in spec_s]),
        speedup=speedup,
        identical=identical,
        metrics=metrics,
        verify_us=verify_us,
        free=free,
        warnings=tuple(d for d in doubts if d is not None),
    )
