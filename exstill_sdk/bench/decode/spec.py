"""End-to-end speculative decoding with the ONNX target: plain vs speculative tokens/s, fixed K
against adaptive K, on a repetitive prompt with the card's prompt-lookup engine (or a draft
image). Every speculative output is checked against the plain greedy output.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from exstill_sdk.adapters.onnx import OnnxTarget
from exstill_sdk.card import open_card
from exstill_sdk.harness.synthetic import image_or_synthetic
from exstill_sdk.harness.timing import best_of
from exstill_sdk.speculative import SpeculativeDecoder

POSITIONS = 2048


def _prompt(vocab: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    pattern = rng.integers(0, vocab, 40).tolist()
    return pattern * 4


def run(
    image_path: str | None = None,
    *,
    synthetic: str | None = None,
    draft_image: str | None = None,
    new_tokens: int = 128,
    ks: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8),
    repeats: int = 2,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="exstill-bench-spec-") as tmp:
        path = image_or_synthetic(Path(tmp), image_path, synthetic, "a target image")
        target = OnnxTarget(path, max_sequences=2, positions=POSITIONS)
        prompt = _prompt(target.vocab_size)
        plain_s, plain = best_of(repeats, target.greedy, prompt, new_tokens)
        url = f"emu://?context={POSITIONS}" + (f"&image={draft_image}" if draft_image else "")
        draft_name = None
        configs: list[int | str] = [*ks, "adaptive"]
        rows = []

        def generate(card: Any, k: int | str, times: int) -> tuple[float, Any]:
            decoder = SpeculativeDecoder(
                card,
                target,
                draft=draft_name,
                k=k,  # type: ignore[arg-type]
                max_k=max(ks),
            )
            return best_of(times, decoder.generate, prompt, new_tokens, stop_token_ids=[])

        with open_card(url) as card:
            if draft_image:
                draft_name = card.info().targets[0].name
            for k in configs:
                seconds, result = generate(card, k, repeats)
                m = result.metrics
                rows.append(
                    {
                        "k": k,
                        "tokens_per_s": round(new_tokens / seconds, 1),
                        "speedup": round(plain_s / seconds, 2),
                        "mean_acceptance_length": round(m.mean_acceptance_length, 3),
                        "acceptance_rate": round(m.acceptance_rate, 3),
                        "prefetch_hits": m.prefetch_hits,
                        "k_chosen": dict(sorted(m.k_chosen.items())),
                        "exact": result.tokens == plain,
                    }
                )
        fixed = [r for r in rows if r["k"] != "adaptive"]
        best = max(fixed, key=lambda r: r["tokens_per_s"])
        # Head to head: the best fixed K and adaptive K again, alternating, best of each.
        with open_card(url) as card:
            duel: dict[int | str, float] = {}
            for k in [best["k"], "adaptive"] * repeats:
                seconds, _ = generate(card, k, 1)
                duel[k] = min(duel.get(k, float("inf")), seconds)
    adaptive = rows[-1]
    return {
        "target": Path(path).name if not synthetic else f"synthetic-{synthetic}",
        "draft": draft_name or "lookup",
        "prompt_tokens": len(prompt),
        "new_tokens": new_tokens,
        "plain_tokens_per_s": round(new_tokens / plain_s, 1),
        "runs": rows,
        "best_fixed_k": best["k"],
        "best_fixed_tokens_per_s": round(new_tokens / duel[best["k"]], 1),
        "adaptive_tokens_per_s": round(new_tokens / duel["adaptive"], 1),
        "adaptive_vs_best_fixed": round(duel[best["k"]] / duel["adaptive"], 3),
        "adaptive_k_chosen": adaptive["k_chosen"],
        "all_exact": all(r["exact"] for r in rows),
    }
