"""One user on a demo target, end to end with the emulated card: chains only against the shape
chosen per round (``trees="auto"``), beside fixed chains and fixed trees, on held-out prompts
and the demo's own prompt.

Every way decodes the same prompts greedily with a decoder of its own, kept for the whole run
(as a server keeps one) and warmed by an untimed run over every prompt (as the demo's first run
warms its decoder): what a way learns, its K and its shape, it learns once. The ways alternate
within each repeat, each timed against the target alone run just before it on the same prompt,
so that a slow spell of the machine falls on both sides of a ratio. The figure of a way is the
median of its speed-ups over the target alone (with the range); ``auto_over_best_chain`` is the
auto way's median over the best chain way's median. The median falls on the middle prompts
only, so each way's geometric mean over prompts (of each prompt's median) is given too, and
``auto_over_best_chain_geomean`` compares by it: every prompt counts, each as much. A
second decoder of the adaptive chain runs as one more way; what it differs from the first by
(``noise``) is the run's noise, the floor under which no two ways are told apart. ``paired``
compares two ways without the target-alone runs: each repeat's decoding rates side by side
(auto over the best chain by geometric mean, the second adaptive decoder over the first),
the ratio with the least noise. Every output is compared with the target's own greedy output.

``users_run`` is the users curve with shapes: at each user count the adaptive chain against
``trees="auto"`` and each fixed tree (a fixed tree drafts for every sequence of a batch, all
scored in one pass), one decoder a way, alternating, decode tokens/s as the users curve counts
them (``bench/decode/users.py``).
"""

from __future__ import annotations

import statistics
from typing import Any

from exstill_sdk.demo import DRAFT_TARGET, demo_tokenizer
from exstill_sdk.harness.timing import against_plain
from exstill_sdk.protocol.messages import TreeRequest
from exstill_sdk.speculative.decoder import DEFAULT_TREES

DEFAULT_CHAINS = (4, 8, 16)
MAX_K = 16
"""The adaptive ways' longest chain: the demo's text often repeats, and a chain the target
takes whole is what a tree must beat."""


def _name(way: object) -> str:
    if way == "auto":
        return "auto (adaptive K, trees where they pay)"
    if way == "adaptive":
        return "chain, adaptive K"
    if way == "adaptive again":
        return "chain, adaptive K (again: the run's noise)"
    if isinstance(way, TreeRequest):
        return f"tree of {way.nodes} (top-{way.top_k}, depth {way.depth})"
    return f"chain, K={way}"


def _options(way: object) -> tuple[Any, Any]:
    """The decoder's ``k`` and ``trees`` for a way: a fixed chain K, a fixed tree (adaptive K
    for the rounds it leaves to chains), the adaptive chain, or auto."""
    if isinstance(way, int):
        return way, "off"
    if isinstance(way, TreeRequest):
        return "adaptive", way
    return "adaptive", "auto" if way == "auto" else "off"


def run(
    *,
    target: str = "large",
    prompts: int = 1,
    prompt_tokens: int = 96,
    new_tokens: int = 128,
    repeats: int = 3,
    chains: tuple[int, ...] = DEFAULT_CHAINS,
    trees: tuple[TreeRequest, ...] = DEFAULT_TREES,
) -> dict[str, Any]:
    from exstill_sdk.demo import demo_target
    from exstill_sdk.demo.run import DEFAULT_PROMPT
    from exstill_sdk.harness.demo_setup import demo_card, demo_onnx_target
    from exstill_sdk.speculative import SpeculativeDecoder

    ways: list[object] = ["adaptive", *chains, "auto", *trees, "adaptive again"]
    with demo_card(max(prompts, 1), prompt_tokens) as (card, held_out):
        inputs = [*held_out[:prompts], demo_tokenizer().encode(DEFAULT_PROMPT).ids]
        model = demo_onnx_target(demo_target(target).image, [1], inputs)
        want = [model.greedy(p, new_tokens) for p in inputs]
        # One decoder a way, as a server keeps one: what it learns (K, the shape) it learns
        # once, in an untimed run over every prompt, as the demo's first run does.
        decoders = {}
        for way in ways:
            k, shape = _options(way)
            decoders[_name(way)] = SpeculativeDecoder(
                card, model, draft=DRAFT_TARGET, k=k, max_k=MAX_K, trees=shape
            )
            for prompt in inputs:
                decoders[_name(way)].generate(prompt, new_tokens, stop_token_ids=[])
        speedups: dict[str, list[float]] = {_name(w): [] for w in ways}
        per_prompt: dict[str, list[list[float]]] = {_name(w): [[] for _ in inputs] for w in ways}
        rates: dict[str, list[list[float]]] = {_name(w): [[] for _ in inputs] for w in ways}
        shapes: dict[str, dict[str, int]] = {}
        accept: dict[str, list[float]] = {_name(w): [] for w in ways}
        exact = True
        for _ in range(repeats):
            for i, (prompt, reference) in enumerate(zip(inputs, want, strict=True)):
                for name, decoder in decoders.items():
                    speedup, result = against_plain(model, decoder, prompt, new_tokens)
                    exact = exact and result.tokens == reference
                    speedups[name].append(speedup)
                    per_prompt[name][i].append(speedup)
                    rates[name][i].append(result.metrics.emitted_tokens / result.metrics.total_s)
                    accept[name].append(result.metrics.mean_acceptance_length)
                    if name == _name("auto"):
                        chosen = shapes.setdefault(f"prompt {i}", {})
                        for shape, n in result.metrics.shapes_chosen.items():
                            chosen[shape] = chosen.get(shape, 0) + n
    rows = [
        {
            "way": name,
            "speedup_median": round(statistics.median(v), 3),
            "speedup_range": [round(min(v), 3), round(max(v), 3)],
            "speedup_by_prompt": [round(statistics.median(p), 3) for p in per_prompt[name]],
            "speedup_geomean": _geomean_of_medians(per_prompt[name]),
            "mean_acceptance_length": round(statistics.mean(accept[name]), 2),
        }
        for name, v in speedups.items()
    ]
    medians = {str(row["way"]): float(row["speedup_median"]) for row in rows}  # type: ignore[arg-type]
    geomeans = {str(row["way"]): float(row["speedup_geomean"]) for row in rows}  # type: ignore[arg-type]
    again, adaptive = _name("adaptive again"), _name("adaptive")
    chain_ways = [w for w in medians if w.startswith("chain") and w != again]
    best_chain = max(chain_ways, key=medians.__getitem__)
    best_by_geomean = max(chain_ways, key=geomeans.__getitem__)
    return {
        "target": target,
        "prompts": len(inputs),
        "new_tokens": new_tokens,
        "repeats": repeats,
        "exact": exact,
        "rows": rows,
        "best_chain": best_chain,
        "auto_over_best_chain": round(medians[_name("auto")] / medians[best_chain], 3),
        "best_chain_geomean": best_by_geomean,
        "auto_over_best_chain_geomean": round(
            geomeans[_name("auto")] / geomeans[best_by_geomean], 3
        ),
        "auto_shapes_chosen": shapes,
        "noise": {
            "again_over_adaptive": round(medians[again] / medians[adaptive], 3),
            "again_over_adaptive_geomean": round(geomeans[again] / geomeans[adaptive], 3),
        },
        "paired": {
            "auto_over_best_chain": paired_ratio(rates[_name("auto")], rates[best_by_geomean]),
            "again_over_adaptive": paired_ratio(rates[again], rates[adaptive]),
        },
    }


def paired_ratio(way: list[list[float]], other: list[list[float]]) -> float:
    """One way's decoding rate over another's, each repeat's runs side by side (no target-alone
    run in between to add its own noise): the geometric mean over prompts of each prompt's
    median ratio."""
    return _geomean_of_medians(
        [
            [a / b for a, b in zip(mine, theirs, strict=True)]
            for mine, theirs in zip(way, other, strict=True)
        ]
    )


def _geomean_of_medians(by_prompt: list[list[float]]) -> float:
    """The geometric mean over prompts of each prompt's median: every prompt counts as much."""
    return round(statistics.geometric_mean(statistics.median(p) for p in by_prompt), 3)


def table(result: dict[str, Any]) -> str:
    lines = [
        f"one user, {result['target']} demo target, {result['prompts']} prompts x "
        f"{result['new_tokens']} tokens, {result['repeats']} alternating repeats; speed-up over "
        "the target alone, median (range) and by prompt",
    ]
    for row in result["rows"]:
        low, high = row["speedup_range"]
        by_prompt = " ".join(f"{s:.2f}" for s in row["speedup_by_prompt"])
        lines.append(
            f"  {row['way']:<42} {row['speedup_median']:.2f}x ({low:.2f}-{high:.2f})  "
            f"geomean {row['speedup_geomean']:.2f}x  by prompt {by_prompt}  "
            f"accepted {row['mean_acceptance_length']:.2f}/pass"
        )
    lines.append(
        f"auto over the best chain by median ({result['best_chain']}): "
        f"{result['auto_over_best_chain']:.3f}x; by geometric mean over prompts "
        f"({result['best_chain_geomean']}): {result['auto_over_best_chain_geomean']:.3f}x; "
        f"identical output: {'yes' if result['exact'] else 'NO'}"
    )
    noise = result["noise"]
    lines.append(
        "the run's noise: the adaptive chain's second decoder over its first "
        f"{noise['again_over_adaptive']:.3f}x by median, "
        f"{noise['again_over_adaptive_geomean']:.3f}x by geometric mean"
    )
    paired = result["paired"]
    lines.append(
        "paired (each repeat's decoding rates side by side, geometric mean over prompts): auto "
        f"over {result['best_chain_geomean']} {paired['auto_over_best_chain']:.3f}x; the "
        f"adaptive chain's second decoder over its first {paired['again_over_adaptive']:.3f}x"
    )
    for prompt, chosen in result["auto_shapes_chosen"].items():
        lines.append(
            f"  auto chose, {prompt}: " + ", ".join(f"{s}: {n}" for s, n in chosen.items())
        )
    return "\n".join(lines)


def users_run(
    *,
    target: str = "large",
    users: tuple[int, ...] = (1, 2, 4, 8),
    prompt_tokens: int = 96,
    new_tokens: int = 128,
    repeats: int = 2,
    trees: tuple[TreeRequest, ...] = DEFAULT_TREES,
) -> dict[str, Any]:
    from exstill_sdk.bench.decode.users import speculative_rate
    from exstill_sdk.demo import demo_target
    from exstill_sdk.harness.demo_setup import demo_card, demo_onnx_target
    from exstill_sdk.speculative import SpeculativeDecoder

    ways: list[object] = ["adaptive", "auto", *trees]
    rows = []
    with demo_card(max(users), prompt_tokens) as (card, prompts):
        model = demo_onnx_target(demo_target(target).image, users, prompts)
        decoders = {}
        for way in ways:
            k, shape = _options(way)
            decoders[_name(way)] = decoder = SpeculativeDecoder(
                card, model, draft=DRAFT_TARGET, k=k, max_k=MAX_K, trees=shape
            )
            decoder.generate_batch(prompts[: max(users)], 32, stop_token_ids=[])  # warm
        chain = _name("adaptive")
        for n in users:
            batch = prompts[:n]
            reference = model.greedy_batch(batch, new_tokens)
            rates: dict[str, list[float]] = {name: [] for name in decoders}
            exact = True
            for rep in range(repeats):
                names = list(decoders)
                for name in names[rep % len(names) :] + names[: rep % len(names)]:
                    rate, outs = speculative_rate(decoders[name], batch, new_tokens)
                    rates[name].append(rate["decode"])
                    exact = exact and outs == reference
            rows.append(
                {
                    "users": n,
                    "exact": exact,
                    "tokens_per_s": {
                        name: round(statistics.median(v), 1) for name, v in rates.items()
                    },
                    "over_chain": {
                        name: round(
                            statistics.median(a / b for a, b in zip(v, rates[chain], strict=True)),
                            3,
                        )
                        for name, v in rates.items()
                        if name != chain
                    },
                }
            )
    return {
        "target": target,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "rows": rows,
        "exact": all(row["exact"] for row in rows),
    }


def users_table(result: dict[str, Any]) -> str:
    lines = [
        f"users curve with shapes, {result['target']} demo target, {result['new_tokens']} "
        f"tokens a user, {result['repeats']} alternating repeats; decode tokens/s (over the "
        "adaptive chain, median of the per-repeat ratios)"
    ]
    for row in result["rows"]:
        parts = []
        for name, rate in row["tokens_per_s"].items():
            ratio = row["over_chain"].get(name)
            parts.append(f"{name}: {rate}" + (f" ({ratio:.2f}x)" if ratio else ""))
        lines.append(f"  {row['users']:>2} users: " + "; ".join(parts))
    lines.append(f"identical output: {'yes' if result['exact'] else 'NO'}")
    return "\n".join(lines)
