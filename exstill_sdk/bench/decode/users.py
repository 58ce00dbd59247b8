"""The users curve: many users on the memory-bound demo target, plain batching against the card.

For each user count U, in one run and alternated (the order rotates every repeat):

- plain: ``OnnxTarget.greedy_batch``, one onnxruntime run a step for all U sequences;
- speculative with adaptive K (``BatchK``: K per sequence from the measured pass cost);
- speculative with each fixed K of ``ks`` for every sequence.

Each way's decoder is one object for the whole run, as in a server: K is learnt once per
decoder (what a pass costs is the target's, not a batch's), so the adaptive decoder runs once
on every prompt before the first measurement and carries what it learnt from one load to the
next. A cold decoder spends its first passes measuring (K = 0 and probes); on a run of 128
tokens that is a tenth of the window.

The card is the emulator in its own process on its own core (12 streams: above 12 users the
others run with the target alone until a stream frees, the seed's second wave); the target and
the host's loop are on the other. Figures are decode tokens/s with every user decoding: the
tokens emitted after each user's first round and before the first user has all its tokens,
over that time. That is what U concurrent users see in a server that keeps U requests running
(a new one starts as one ends): the prompt pass is what a serving engine reports apart as time
to first token, and a closed batch's drain, when the last few requests run on alone, is not a
load of U. Plain batching's steps all run at U. ``whole_run_tokens_per_s`` counts everything,
prompt and drain included. Each figure is the median over the repeats, speed-ups the median
of the per-repeat ratios. Every output is compared with the plain batch's (``exact``). Each
way's acceptance and K chosen are its last run's, and so is ``card_prefetch``: the card's own
prefetch counters over that run (hits by accepted length, on other outcomes, misses, late,
tokens thrown away).

``limit`` is what the pair allows at that load: the best over K of the mean acceptance length
measured at K times the cost of a plain pass of U tokens over a pass of U(K + 1) tokens (the
pass costs measured here, ``pass_ms``): the speed-up of a free draft with no host or card time.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Literal

from exstill_sdk.demo import DRAFT_TARGET
from exstill_sdk.harness.demo_setup import demo_card, demo_onnx_target
from exstill_sdk.harness.passes import pass_seconds
from exstill_sdk.support.prefetch import prefetch_report

CARD_STREAMS = 12
WARM_UP_TOKENS = 32
"""The adaptive decoder's first run, on every prompt: a server's decoder has run before it is
measured."""


def plain_rate(
    target: Any, batch: list[list[int]], new_tokens: int
) -> tuple[dict[str, float], list[list[int]]]:
    """Plain batched decoding of ``batch`` (one onnxruntime run a step for all): tokens/s of
    its decode steps (every user decoding) and of the whole run; the outputs."""
    started = time.perf_counter()
    times: list[float] = []
    outs = target.greedy_batch(batch, new_tokens, step_times=times)
    end = time.perf_counter()
    n = len(batch)
    return {
        "decode": n * (new_tokens - 1) / max(sum(times[1:]), 1e-9),
        "overall": n * new_tokens / (end - started),
    }, outs


def speculative_rate(
    decoder: Any, batch: list[list[int]], new_tokens: int, rounds: list[int] | None = None
) -> tuple[dict[str, float], list[list[int]]]:
    """``decoder`` on ``batch``, timed as ``decode_rate`` counts it; the outputs. ``rounds``,
    where given, gets the tokens of every round counted (each user's accepted tokens and the
    target's one after them)."""
    started = time.perf_counter()
    events = partial(decoder.stream_batch, batch, new_tokens, stop_token_ids=[])
    return decode_rate(events, len(batch), new_tokens, started, rounds)


def decode_rate(
    events: Callable[[], Any],
    users: int,
    new_tokens: int,
    started: float,
    rounds: list[int] | None = None,
) -> tuple[dict[str, float], list[list[int]]]:
    """Consume (user, tokens) events: tokens/s while every user is decoding (after each has
    its first round, until the first has all its tokens) and over the whole run; the outputs.
    ``rounds`` gets the length of each event in that window."""
    outs: list[list[int]] = [[] for _ in range(users)]
    waiting = set(range(users))
    first_at, first_tokens = started, 0
    window: tuple[float, int] | None = None
    for user, tokens in events():
        outs[user] += tokens
        if waiting:
            waiting.discard(user)
            if not waiting:
                first_at, first_tokens = time.perf_counter(), sum(map(len, outs))
        elif window is None:
            if rounds is not None:
                rounds.append(len(tokens))
            if len(outs[user]) >= new_tokens:
                window = (time.perf_counter(), sum(map(len, outs)))
    end = time.perf_counter()
    total = sum(map(len, outs))
    last_at, last_tokens = window or (end, total)
    return {
        "decode": (last_tokens - first_tokens) / max(last_at - first_at, 1e-9),
        "overall": total / (end - started),
    }, outs


def run(
    *,
    users: Sequence[int] = (1, 2, 4, 8, 12, 16),
    ks: Sequence[int] = (1, 2, 3, 4, 6, 8),
    prompt_tokens: int = 96,
    new_tokens: int = 128,
    repeats: int = 2,
    progress: bool = False,
) -> dict[str, Any]:
    from exstill_sdk.demo import demo_target
    from exstill_sdk.speculative import SpeculativeDecoder

    large = demo_target("large", progress=progress)
    rows: list[dict[str, Any]] = []
    with demo_card(max(users), prompt_tokens) as (card, prompts):
        target = demo_onnx_target(large.image, users, prompts)
        choices: list[int | Literal["adaptive"]] = ["adaptive", *ks]
        decoders = {
            str(k): SpeculativeDecoder(card, target, draft=DRAFT_TARGET, k=k, max_k=max(ks))
            for k in choices
        }
        decoders["adaptive"].generate_batch(prompts, WARM_UP_TOKENS, stop_token_ids=[])
        for n in users:
            if progress:
                print(f"users {n} ...", file=sys.stderr, flush=True)
            rows.append(_row(decoders, target, prompts[:n], new_tokens, repeats))
    return {
        "target": large.description,
        "parameters": large.parameters,
        "card_streams": CARD_STREAMS,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "rows": rows,
        "exact": all(r["exact"] for r in rows),
    }


def _row(
    decoders: dict[str, Any],
    target: Any,
    batch: list[list[int]],
    new_tokens: int,
    repeats: int,
) -> dict[str, Any]:
    from exstill_sdk.speculative.metrics import SpecMetrics

    n = len(batch)
    ways: list[str] = ["plain", *decoders]
    rates: dict[str, list[dict[str, float]]] = {w: [] for w in ways}
    details: dict[str, Any] = {}
    reference: list[list[int]] | None = None
    exact = True
    for rep in range(repeats):
        order = ways[rep % len(ways) :] + ways[: rep % len(ways)]
        for way in order:
            if way == "plain":
                rate, outs = plain_rate(target, batch, new_tokens)
                reference = reference or outs
            else:
                decoder = decoders[way]
                decoder.metrics = SpecMetrics(max_k=decoder.max_k)  # this run's alone
                before = decoder.card.stats()
                rate, outs = speculative_rate(decoder, batch, new_tokens)
                m = decoder.metrics
                details[way] = {
                    "mean_acceptance_length": round(m.mean_acceptance_length, 3),
                    "k_chosen": {str(k): v for k, v in sorted(m.k_chosen.items())},
                    "prefetch_hits": m.prefetch_hits,
                    "rounds": m.rounds,
                    "card_prefetch": prefetch_report(decoder.card.stats(), before),
                }
            rates[way].append(rate)
            if reference is not None and outs != reference:
                exact = False
    plain = rates["plain"]
    out: dict[str, Any] = {
        "users": n,
        "streams_used": min(n, CARD_STREAMS),
        "waves": math.ceil(n / CARD_STREAMS),
        "plain_tokens_per_s": _median(plain, "decode"),
        "plain_whole_run_tokens_per_s": _median(plain, "overall"),
    }
    for way in ways[1:]:
        ratios = [r["decode"] / p["decode"] for r, p in zip(rates[way], plain, strict=True)]
        entry = {
            "tokens_per_s": _median(rates[way], "decode"),
            "whole_run_tokens_per_s": _median(rates[way], "overall"),
            "speedup": round(statistics.median(ratios), 3),
            "speedup_range": [round(min(ratios), 3), round(max(ratios), 3)],
            **details[way],
        }
        if way == "adaptive":
            out["adaptive"] = entry
        else:
            out.setdefault("fixed_k", {})[way] = entry
    fixed = out["fixed_k"]
    best = max(fixed, key=lambda k: fixed[k]["tokens_per_s"])
    out["best_fixed_k"] = int(best)
    out["adaptive_vs_best_fixed"] = round(
        out["adaptive"]["tokens_per_s"] / fixed[best]["tokens_per_s"], 3
    )
    out["speedup"] = out["adaptive"]["speedup"]
    out["pass_ms"] = pass_costs(target, batch, [0, *map(int, fixed)])
    out["limit"] = _limit(out["pass_ms"], fixed, n)
    out["exact"] = exact
    return out


def _median(rates: list[dict[str, float]], key: str) -> float:
    return round(statistics.median(r[key] for r in rates), 1)


def pass_costs(
    target: Any, batch: list[list[int]], ks: Sequence[int], turns: int = 3
) -> dict[str, float]:
    """Milliseconds of one verification pass of every user with K drafted tokens each, keyed
    by the tokens in the pass: the median over ``turns`` turns through the K, each K run three
    times in a row and its first run left out (harness.passes)."""
    samples = pass_seconds(target, batch, ks, turns=turns, runs=2, warmup=1)
    n = len(batch)
    return {str(n * (k + 1)): round(statistics.median(v) * 1e3, 2) for k, v in samples.items()}


def _limit(pass_ms: dict[str, float], fixed: dict[str, Any], n: int) -> float:
    """The best over K of mean acceptance length x plain pass / pass with K drafted each."""
    plain = pass_ms[str(n)]
    return round(
        max(
            fixed[k]["mean_acceptance_length"] * plain / pass_ms[str(n * (int(k) + 1))]
            for k in fixed
        ),
        2,
    )
