"""A pool of cards against one card: U users on the memory-bound demo target.

Three ways, alternated (the order rotates every repeat), each decoder one object for the run:

- plain: the target alone, batched (``OnnxTarget.greedy_batch``), for exactness and speed-ups;
- one card: the first card of the pool alone (12 streams: users beyond them run with the target
  alone until a stream frees, the seed's second wave);
- the pool: every card (``CardPool``), a stream for every user up to the sum of the slots.

The cards are served by one ``exstill-emu --cards N`` process on a core of its own, the target
and the host on the other: on this machine the cards share one core, where real cards have
silicon each. Figures are decode tokens/s while every user decodes (users.py's window), medians
over the repeats and their range; every output is compared with the plain batch's.
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

from exstill_sdk.bench.decode.users import WARM_UP_TOKENS, plain_rate, speculative_rate
from exstill_sdk.demo import DRAFT_TARGET
from exstill_sdk.harness.demo_setup import demo_cards, demo_onnx_target

WAYS = ("plain", "one_card", "pool")


def run(
    *,
    users: int = 24,
    cards: int = 2,
    prompt_tokens: int = 96,
    new_tokens: int = 96,
    repeats: int = 3,
    progress: bool = False,
) -> dict[str, Any]:
    from exstill_sdk.card import open_card
    from exstill_sdk.demo import demo_target
    from exstill_sdk.pool import CardPool, split_card_urls
    from exstill_sdk.speculative import SpeculativeDecoder
    from exstill_sdk.speculative.metrics import SpecMetrics

    large = demo_target("large", progress=progress)
    with demo_cards(cards, users, prompt_tokens) as (url, prompts):
        urls = split_card_urls(url)
        with open_card(urls[0]) as one, CardPool(urls) as pool:
            target = demo_onnx_target(large.image, [users], prompts)
            streams = {"one_card": one.info().slots, "pool": pool.info().slots}
            decoders = {
                "one_card": SpeculativeDecoder(one, target, draft=DRAFT_TARGET, k="adaptive"),
                "pool": SpeculativeDecoder(pool, target, draft=DRAFT_TARGET, k="adaptive"),
            }
            for decoder in decoders.values():  # a server's decoder has run before
                decoder.generate_batch(prompts, WARM_UP_TOKENS, stop_token_ids=[])
            rates: dict[str, list[float]] = {way: [] for way in WAYS}
            reference: list[list[int]] | None = None
            exact = True
            details: dict[str, Any] = {}
            for rep in range(repeats):
                if progress:
                    print(f"repeat {rep + 1} of {repeats} ...", file=sys.stderr, flush=True)
                order = WAYS[rep % len(WAYS) :] + WAYS[: rep % len(WAYS)]
                for way in order:
                    if way == "plain":
                        rate, outs = plain_rate(target, prompts, new_tokens)
                        reference = reference or outs
                    else:
                        decoder = decoders[way]
                        decoder.metrics = SpecMetrics(max_k=decoder.max_k)
                        placed = [m.placed for m in pool.members]
                        rate, outs = speculative_rate(decoder, prompts, new_tokens)
                        m = decoder.metrics
                        details[way] = {
                            "mean_acceptance_length": round(m.mean_acceptance_length, 3),
                            "rounds": m.rounds,
                            "prefetch_hits": m.prefetch_hits,
                        }
                        if way == "pool":
                            details[way]["streams_placed"] = [
                                m.placed - before
                                for m, before in zip(pool.members, placed, strict=True)
                            ]
                    rates[way].append(rate["decode"])
                    if reference is not None and outs != reference:
                        exact = False
    ratio = [p / o for p, o in zip(rates["pool"], rates["one_card"], strict=True)]
    return {
        "target": large.description,
        "users": users,
        "cards": cards,
        "streams": streams,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "tokens_per_s": {way: _summary(rates[way]) for way in WAYS},
        "speedup": {
            way: round(
                statistics.median(r / p for r, p in zip(rates[way], rates["plain"], strict=True)),
                3,
            )
            for way in WAYS[1:]
        },
        "pool_vs_one_card": round(statistics.median(ratio), 3),
        "pool_vs_one_card_range": [round(min(ratio), 3), round(max(ratio), 3)],
        "details": details,
        "exact": exact,
    }


def _summary(rates: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(rates), 1),
        "min": round(min(rates), 1),
        "max": round(max(rates), 1),
    }


def table(result: dict[str, Any]) -> str:
    """The run as a few lines of text."""
    t = result["tokens_per_s"]
    d = result["details"]
    lines = [
        f"{result['users']} users on {result['target']}; decode tokens/s, median "
        f"[range] of {result['repeats']} alternated repeats",
        f"  plain (target alone)        {t['plain']['median']:8.1f}  "
        f"[{t['plain']['min']}-{t['plain']['max']}]",
    ]
    for way, name in (("one_card", "one card"), ("pool", f"pool of {result['cards']} cards")):
        lines.append(
            f"  {name + ' (' + str(result['streams'][way]) + ' streams)':<28}"
            f"{t[way]['median']:8.1f}  [{t[way]['min']}-{t[way]['max']}]  "
            f"{result['speedup'][way]:.2f}x plain, acceptance "
            f"{d[way]['mean_acceptance_length']}"
        )
    lo, hi = result["pool_vs_one_card_range"]
    lines.append(
        f"  pool against one card: {result['pool_vs_one_card']:.2f}x [{lo:.2f}-{hi:.2f}]; "
        f"streams placed per card {d['pool'].get('streams_placed')}; exact: {result['exact']}"
    )
    return "\n".join(lines)
