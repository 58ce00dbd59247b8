"""K policies replayed on real texts: the adaptive policy against every fixed K, without the
machine's noise (speculative/replay.py).

``measure`` records, on the demo pair with the emulated card in its own process, each prompt's
acceptance record (the target's greedy text; where the card's greedy draft proposes each of its
tokens) and the round's costs: the target's pass by tokens scored (``verify_curve``, the
median of 5 turns through n = 1..17); the card drafting a token,
from its drafts of 1 and of 16; the host's share of a round and the card's round trip, from a
real run at K = 4. It also runs the real decoder on the same prompts at two fixed K and
adaptively, each against the target alone just before it: how far the replay's cost model is
from the machine. ``replay_all`` replays every fixed K and the adaptive policy over those
records: one adaptive policy for all prompts, first over every prompt untimed, as
``exstill-bench shapes`` warms a decoder.

The figure of interest is the adaptive policy over each prompt's best fixed K, and over the best
single fixed K by the median over prompts (what ``exstill-bench shapes`` calls the best chain).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any, Literal

from exstill_sdk.harness.speedup import verify_curve
from exstill_sdk.harness.timing import against_plain, timed
from exstill_sdk.speculative.adaptive import AdaptiveK, FixedK, KPolicy
from exstill_sdk.speculative.replay import RoundCosts, record_kept, replay

MAX_K = 16
"""As ``exstill-bench shapes``: the demo's text often repeats."""
CHECK_KS = (4, 8)
SAMPLES = 7
"""Timed calls whose median ``_median_time`` gives (a greedy run of the target: 3)."""


def _median_time(run: Callable[[], object], samples: int = SAMPLES) -> float:
    return statistics.median(timed(run)[0] for _ in range(samples))


def _costs(
    card: Any, model: Any, prompt: list[int], output: list[int], kept: list[bool], draft: str
) -> RoundCosts:
    """The pair's round costs, measured (module docstring)."""
    from exstill_sdk.speculative import SpeculativeDecoder

    curve = verify_curve(model, [*prompt, *output[: len(output) // 2]], range(1, MAX_K + 2))
    verify = tuple(curve[str(n)] / 1e6 for n in range(1, MAX_K + 2))
    steps = 32
    prompt_s = _median_time(lambda: model.greedy(prompt, 1), 3)
    plain = _median_time(lambda: model.greedy(prompt, steps + 1), 3) - prompt_s
    with card.open_stream(target=draft) as stream:
        stream.prefill(list(prompt))
        one = _median_time(lambda: stream.draft(1))
        many = _median_time(lambda: stream.draft(MAX_K))
    decoder = SpeculativeDecoder(card, model, draft=draft, k=4, max_k=MAX_K)
    decoder.generate(prompt, len(output), stop_token_ids=[])  # warm
    m = decoder.generate(prompt, len(output), stop_token_ids=[]).metrics
    token = max(0.0, (many - one) / (MAX_K - 1))
    host = m.host_s / m.rounds
    # the round trip: what the K = 4 run waited a round, less the wait the replay's card model
    # gives the same rounds without one
    bare = RoundCosts(verify, host, 0.0, token, 1.0)
    modelled = replay(FixedK(4), kept, bare, MAX_K)
    return RoundCosts(
        verify_s=verify,
        host_s=host,
        card_hit_s=max(0.0, (m.card_wait_s - modelled.card_s) / m.rounds),
        card_token_s=token,
        plain_s=plain / steps,
        prompt_s=prompt_s,
    )


def measure(
    *, target: str = "large", prompts: int = 3, prompt_tokens: int = 96, new_tokens: int = 128
) -> dict[str, Any]:
    """Every prompt's acceptance record and the pair's round costs (module docstring)."""
    from exstill_sdk.demo import DRAFT_TARGET, demo_target, demo_tokenizer
    from exstill_sdk.demo.run import DEFAULT_PROMPT
    from exstill_sdk.harness.demo_setup import demo_card, demo_onnx_target

    with demo_card(max(prompts, 1), prompt_tokens) as (card, held_out):
        inputs = [*held_out[:prompts], demo_tokenizer().encode(DEFAULT_PROMPT).ids]
        model = demo_onnx_target(demo_target(target).image, [1], inputs)
        outputs = [model.greedy(p, new_tokens) for p in inputs]
        kept = [record_kept(card, DRAFT_TARGET, p, o) for p, o in zip(inputs, outputs, strict=True)]
        costs = _costs(card, model, inputs[0], outputs[0], kept[0], DRAFT_TARGET)
        checked = _check(card, model, inputs, outputs, DRAFT_TARGET)
    return {
        "target": target,
        "new_tokens": new_tokens,
        "kept": ["".join("1" if k else "0" for k in record) for record in kept],
        "costs": {
            "verify_ms": [round(s * 1e3, 4) for s in costs.verify_s],
            "host_ms": round(costs.host_s * 1e3, 4),
            "card_hit_ms": round(costs.card_hit_s * 1e3, 4),
            "card_token_ms": round(costs.card_token_s * 1e3, 4),
            "plain_ms": round(costs.plain_s * 1e3, 4),
            "prompt_ms": round(costs.prompt_s * 1e3, 4),
        },
        "measured": checked,
    }


def _check(
    card: Any, model: Any, inputs: list[list[int]], outputs: list[list[int]], draft: str
) -> dict[str, list[float]]:
    """The real decoder's speed-ups by prompt at ``CHECK_KS`` and adaptively: one decoder a
    way, warmed over every prompt, each run against the target alone just before it."""
    from exstill_sdk.speculative import SpeculativeDecoder

    n = len(outputs[0])
    ways: dict[str, SpeculativeDecoder] = {}
    settings: list[tuple[str, int | Literal["adaptive"]]] = [(f"K={k}", k) for k in CHECK_KS]
    for name, k in [*settings, ("adaptive", "adaptive")]:
        ways[name] = SpeculativeDecoder(card, model, draft=draft, k=k, max_k=MAX_K)
        for prompt in inputs:
            ways[name].generate(prompt, n, stop_token_ids=[])
    out: dict[str, list[float]] = {name: [] for name in ways}
    for prompt, reference in zip(inputs, outputs, strict=True):
        for name, decoder in ways.items():
            speedup, result = against_plain(model, decoder, prompt, n)
            if result.tokens != reference:
                raise AssertionError(f"{name}: output differs from the target's greedy output")
            out[name].append(round(speedup, 3))
    return out


def costs_of(record: dict[str, Any]) -> RoundCosts:
    """``measure``'s costs back as RoundCosts."""
    c = record["costs"]
    return RoundCosts(
        verify_s=tuple(ms / 1e3 for ms in c["verify_ms"]),
        host_s=c["host_ms"] / 1e3,
        card_hit_s=c["card_hit_ms"] / 1e3,
        card_token_s=c["card_token_ms"] / 1e3,
        plain_s=c["plain_ms"] / 1e3,
        prompt_s=c.get("prompt_ms", 0.0) / 1e3,
    )


def replay_all(
    record: dict[str, Any],
    policies: dict[str, Callable[[], KPolicy]] | None = None,
    *,
    jitter: float = 0.0,
    seeds: int = 1,
) -> dict[str, Any]:
    """Every fixed K 1..MAX_K and each of ``policies`` (default: ``AdaptiveK``) replayed over
    ``measure``'s records; speed-ups over the target alone, each the mean over ``seeds``
    replays whose passes vary by ``jitter`` (the same draws for every way)."""
    costs = costs_of(record)
    texts = [[c == "1" for c in text] for text in record["kept"]]
    ways: dict[str, Callable[[], KPolicy]] = {
        **{f"K={k}": partial(FixedK, k) for k in range(1, MAX_K + 1)},
        **(policies or {"adaptive": lambda: AdaptiveK(MAX_K)}),
    }
    rows: dict[str, list[float]] = {}
    chosen: dict[str, list[dict[int, int]]] = {}
    for name, make in ways.items():
        sums = [0.0] * len(texts)
        counts: list[Counter[int]] = [Counter() for _ in texts]
        for seed in range(seeds):
            policy = make()
            for i, text in enumerate(texts):  # warm, as a server's decoder is
                replay(policy, text, costs, MAX_K, jitter=jitter, seed=-1 - i - seed * len(texts))
            for i, text in enumerate(texts):
                run = replay(policy, text, costs, MAX_K, jitter=jitter, seed=i + seed * len(texts))
                sums[i] += run.speedup(costs) / seeds
                counts[i].update(run.k_chosen)
        rows[name] = sums
        chosen[name] = [dict(sorted(c.items())) for c in counts]
    adaptive = [name for name in ways if not name.startswith("K=")]
    fixed = [name for name in rows if name.startswith("K=")]
    best_fixed = max(fixed, key=lambda name: statistics.median(rows[name]))
    best_by_prompt = [max(rows[name][i] for name in fixed) for i in range(len(texts))]
    return {
        "jitter": jitter,
        "seeds": seeds,
        "rows": {name: [round(s, 3) for s in v] for name, v in rows.items()},
        "best_fixed": best_fixed,
        "best_by_prompt": [round(s, 3) for s in best_by_prompt],
        "over_best_fixed": {
            name: round(statistics.median(rows[name]) / statistics.median(rows[best_fixed]), 3)
            for name in adaptive
        },
        "over_best_by_prompt": {
            name: [round(s / b, 3) for s, b in zip(rows[name], best_by_prompt, strict=True)]
            for name in adaptive
        },
        "k_chosen": {name: chosen[name] for name in adaptive},
    }


def table(record: dict[str, Any], result: dict[str, Any]) -> str:
    c = record["costs"]
    lines = [
        f"{record['target']} demo target, {len(record['kept'])} prompts x "
        f"{record['new_tokens']} tokens; costs (ms): plain step {c['plain_ms']:.2f}, pass of "
        f"1/9/17 tokens {c['verify_ms'][0]:.2f}/{c['verify_ms'][8]:.2f}/{c['verify_ms'][-1]:.2f}, "
        f"host {c['host_ms']:.2f} a round, card {c['card_hit_ms']:.2f} a hit + "
        f"{c['card_token_ms']:.3f} a token drafted anew",
        "replayed speed-up over the target alone, by prompt (median):",
    ]
    for name, v in result["rows"].items():
        cells = " ".join(f"{s:5.2f}" for s in v)
        lines.append(f"  {name:<10} {cells}  ({statistics.median(v):.2f})")
    for name, ratio in result["over_best_fixed"].items():
        by_prompt = " ".join(f"{s:.3f}" for s in result["over_best_by_prompt"][name])
        lines.append(
            f"{name} over the best fixed K ({result['best_fixed']}): {ratio:.3f}x; over each "
            f"prompt's best fixed K: {by_prompt}"
        )
    for name, v in record.get("measured", {}).items():
        lines.append(f"measured (the real decoder), {name}: " + " ".join(f"{s:.2f}" for s in v))
    return "\n".join(lines)
