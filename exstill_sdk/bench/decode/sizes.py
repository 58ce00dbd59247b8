"""Speed-up against target size: the same distilled draft against the trained demo target and
its function-preserving expansions (exstill_sdk.image.expand), one user, timed like a card.

What it shows: a target whose weights fit in the CPU's cache is bound by arithmetic, so
scoring K+1 tokens costs several plain steps and speculation gains little; once the weights are
well beyond the cache a step is bound by reading them, scoring K+1 tokens costs little more than
one step, and the speed-up approaches mean acceptance length over that cost. Every expansion
writes the small target's text, so acceptance is the same at every size and only the regime
changes.
"""

from __future__ import annotations

from typing import Any

from exstill_sdk.harness.card_process import emulator_process, pinned, split_cores
from exstill_sdk.harness.speedup import measure_speedup
from exstill_sdk.support.prefetch import prefetch_report

DEFAULT_SIZES = ("small", "576", "1408", "2816")
"""The trained 4.2M target and expansions to about 20M, 107M and 404M parameters (hidden 576,
1408, 2816)."""


def run(
    sizes: tuple[str, ...] = DEFAULT_SIZES,
    *,
    prompts: int = 3,
    prompt_tokens: int = 96,
    new_tokens: int = 96,
    runs: int = 2,
    max_k: int = 8,
    progress: bool = False,
) -> dict[str, Any]:
    """One row per size: ``small``, ``large`` or a hidden size to expand the target to; each
    run decodes ``new_tokens`` after each of the first ``prompts`` held-out prompts."""
    from exstill_sdk.adapters.onnx import OnnxTarget
    from exstill_sdk.card import open_card
    from exstill_sdk.demo import DRAFT_TARGET, POSITIONS, THREADS, emulator_args
    from exstill_sdk.demo.pair import draft_model, held_out_prompts
    from exstill_sdk.demo.targets import sized_target
    from exstill_sdk.speculative import SpeculativeDecoder

    inputs = held_out_prompts(prompts, prompt_tokens)
    draft = draft_model()
    host_cpu, card_cpu = split_cores()
    rows = []
    with (
        emulator_process(*emulator_args(), cpu=card_cpu) as url,
        open_card(url) as card,
        pinned(host_cpu),
    ):
        for size in sizes:
            chosen = sized_target(size, progress=progress)
            target = OnnxTarget(chosen.image, positions=POSITIONS, threads=THREADS)
            decoder = SpeculativeDecoder(card, target, draft=DRAFT_TARGET, max_k=max_k)
            before = card.stats()
            result = measure_speedup(target, decoder, inputs, new_tokens, draft=draft, runs=runs)
            rows.append(
                {
                    "size": size,
                    "parameters": chosen.parameters,
                    "weight_mb": round(chosen.image.data_size / 1e6, 1),
                    **result.to_dict(),
                    # the card's own counters over the size's runs (its warm-up run too)
                    "card_prefetch": prefetch_report(card.stats(), before),
                }
            )
            del target, decoder
    return {
        "prompts": len(inputs),
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "runs": runs,
        "placement": f"target on cpu {host_cpu}, emulated card in its own process on cpu {card_cpu}"
        if card_cpu is not None
        else "not pinned (fewer than two CPUs)",
        "rows": rows,
    }
