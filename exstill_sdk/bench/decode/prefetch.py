"""Prefetch on the demo pair: drafting ahead for full acceptance only against drafting ahead for
several verification outcomes, the card in a process of its own on its own core, over TCP.

Each way runs the same rounds: a held-out prompt, then greedy rounds of a fixed K (the target
verifies the card's draft, the COMMIT carries its verdict and asks for the next K) until
``new_tokens`` are kept. The ways alternate, a fresh card each run. Reported per way: the card's
prefetch counters (hits, by accepted length, on other outcomes, late, tokens thrown away); the
host's wait for the card's reply to a COMMIT, hits and misses apart (median and range); and, as
the link's own floor, a PING sent after the same idle time as a verification, so that what the
card adds to a hit is the difference. Every way's kept tokens must equal the target's own
greedy continuation.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from exstill_sdk.support.prefetch import describe, prefetch_report

WAYS: dict[str, tuple[str, ...]] = {
    "full acceptance only": ("--no-outcomes",),
    "several outcomes": (),
}
PINGS = 60


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "median": round(statistics.median(values), 1),
        "min": round(min(values), 1),
        "max": round(max(values), 1),
    }


def _decode(card: Any, model: Any, prompt: list[int], k: int, new_tokens: int) -> dict:
    """Greedy rounds of K on one stream; the kept tokens and each COMMIT's wait (us) by
    whether the reply was a prefetch hit."""
    from exstill_sdk.demo import DRAFT_TARGET
    from exstill_sdk.protocol.drafts import Verdict

    stream = card.open_stream(target=DRAFT_TARGET)
    stream.prefill(prompt)
    context = list(prompt)
    kept: list[int] = []
    waits: dict[str, list[float]] = {"hit": [], "miss": []}
    verify_s: list[float] = []
    draft = stream.draft(k)
    try:
        while len(kept) < new_tokens:
            started = time.perf_counter()
            logits = model.verify(0, context, list(draft.tokens))
            verify_s.append(time.perf_counter() - started)
            best = logits.argmax(axis=-1).tolist()
            accepted = 0
            while accepted < len(draft.tokens) and draft.tokens[accepted] == best[accepted]:
                accepted += 1
            verdict = Verdict(accepted, best[accepted])
            new = draft.kept(verdict)
            context += new
            kept += new
            model.rollback(0, len(context) - 1)
            started = time.perf_counter()
            draft = stream.commit(verdict, k)
            waits["hit" if draft.prefetch_hit else "miss"].append(
                (time.perf_counter() - started) * 1e6
            )
    finally:
        stream.close()
        model.release(0)
    return {"kept": kept[:new_tokens], "waits": waits, "verify_s": verify_s}


def _ping_after(card: Any, idle_s: float) -> list[float]:
    """PING round trips (us), each after ``idle_s`` of the host's own work (a busy loop, as a
    verification keeps the host busy)."""
    out = []
    for _ in range(PINGS):
        until = time.perf_counter() + idle_s
        while time.perf_counter() < until:
            pass
        started = time.perf_counter()
        card.ping()
        out.append((time.perf_counter() - started) * 1e6)
    return out


def run(
    target: str = "large",
    *,
    k: int = 8,
    prompts: int = 3,
    prompt_tokens: int = 96,
    new_tokens: int = 96,
    repeats: int = 2,
    progress: bool = False,
) -> dict[str, Any]:
    """Both ways on ``target`` (small, large or a hidden size the demo target is expanded
    to), ``repeats`` alternating runs each."""
    from exstill_sdk.adapters.onnx import OnnxTarget
    from exstill_sdk.card import open_card
    from exstill_sdk.demo import POSITIONS, THREADS, emulator_args, held_out_prompts
    from exstill_sdk.demo.targets import sized_target
    from exstill_sdk.harness.card_process import emulator_process, pinned, split_cores

    chosen = sized_target(target, progress=progress)
    model = OnnxTarget(chosen.image, positions=POSITIONS, threads=THREADS)
    inputs = held_out_prompts(prompts, prompt_tokens)
    reference = [model.greedy(p, new_tokens) for p in inputs]
    host_cpu, card_cpu = split_cores()
    runs: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
    order = list(WAYS)
    for repeat in range(repeats):
        for way in order if repeat % 2 == 0 else order[::-1]:
            with (
                emulator_process(*emulator_args(), *WAYS[way], cpu=card_cpu) as url,
                open_card(url) as card,
                pinned(host_cpu),
            ):
                before = card.stats()
                decoded = [_decode(card, model, p, k, new_tokens) for p in inputs]
                report = prefetch_report(card.stats(), before)
                verify = statistics.median(s for d in decoded for s in d["verify_s"])
                pings = _ping_after(card, verify)
            runs[way].append(
                {
                    "identical": [d["kept"] for d in decoded] == reference,
                    "prefetch": report,
                    "hit_us": [w for d in decoded for w in d["waits"]["hit"]],
                    "miss_us": [w for d in decoded for w in d["waits"]["miss"]],
                    "ping_us": pings,
                    "verify_ms": verify * 1e3,
                }
            )
    rows = []
    for way, done in runs.items():
        hit_us = [w for r in done for w in r["hit_us"]]
        miss_us = [w for r in done for w in r["miss_us"]]
        ping_us = [w for r in done for w in r["ping_us"]]
        rounds = sum(r["prefetch"]["rounds"] for r in done)
        hits = sum(r["prefetch"]["hits"] for r in done)
        rows.append(
            {
                "way": way,
                "identical": all(r["identical"] for r in done),
                "rounds": rounds,
                "hit_rate": round(hits / rounds, 3) if rounds else 0.0,
                "hit_rate_by_run": [r["prefetch"]["hit_rate"] for r in done],
                "prefetch_by_run": [r["prefetch"] for r in done],
                "hit_reply_us": _spread(hit_us),
                "miss_reply_us": _spread(miss_us),
                "ping_after_verify_us": _spread(ping_us),
                "card_wait_ms_per_round": round(
                    (sum(hit_us) + sum(miss_us)) / 1e3 / max(1, len(hit_us) + len(miss_us)), 3
                ),
                "verify_ms": round(statistics.median(r["verify_ms"] for r in done), 2),
            }
        )
    return {
        "target": chosen.image.target,
        "parameters": chosen.parameters,
        "k": k,
        "prompts": len(inputs),
        "new_tokens": new_tokens,
        "repeats": repeats,
        "placement": f"target on cpu {host_cpu}, emulated card in its own process on cpu {card_cpu}"
        if card_cpu is not None
        else "not pinned (fewer than two CPUs)",
        "rows": rows,
    }


def table(result: dict[str, Any]) -> str:
    def us(s: dict[str, float] | None) -> str:
        return "-" if s is None else f"{s['median']:.0f} ({s['min']:.0f}-{s['max']:.0f})"

    lines = [
        f"prefetch on {result['target']} ({result['parameters'] / 1e6:.1f}M parameters), K = "
        f"{result['k']}, {result['prompts']} held-out prompts x {result['new_tokens']} tokens, "
        f"{result['repeats']} runs each way, alternating; {result['placement']}",
        "",
        "| way | hit rate (by run) | hit reply us | miss reply us | PING after a verify us "
        "| card wait ms/round | identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        by_run = ", ".join(f"{r:.2f}" for r in row["hit_rate_by_run"])
        lines.append(
            f"| {row['way']} | {row['hit_rate']:.3f} ({by_run}) | {us(row['hit_reply_us'])} | "
            f"{us(row['miss_reply_us'])} | {us(row['ping_after_verify_us'])} | "
            f"{row['card_wait_ms_per_round']:.2f} | {'yes' if row['identical'] else 'NO'} |"
        )
    lines.append("")
    for row in result["rows"]:
        for i, report in enumerate(row["prefetch_by_run"]):
            lines.append(f"{row['way']}, run {i + 1}: {describe(report)}")
    return "\n".join(lines)
