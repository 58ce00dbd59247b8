"""The card's draft's ``top_k`` along the target's own text: how often the target's token is
among the draft's k likeliest, over every depth a chain of K reaches, as ``exstill eval``
reports it and ``exstill plan`` reads it (``acceptance.top_k``) to weigh trees and drafting
ahead for several outcomes. The demo draft image is the one the emulated card runs; onnxruntime
runs it here teacher-forced over each prompt and its continuation, one pass a prompt."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from exstill_sdk.evaluation.acceptance import Rounds, rounds, runs_from_matches
from exstill_sdk.evaluation.drafters import draft_ranks


def draft_top_k(
    draft: Any, prompts: Sequence[Sequence[int]], texts: Sequence[Sequence[int]], depth: int
) -> list[float]:
    """``top_k`` (k = 1..8) of ``draft`` (an OnnxTarget) along each prompt's continuation
    ``texts`` (the target's greedy text), for chains of ``depth``; empty without any text."""
    total: Rounds | None = None
    for prompt, text in zip(prompts, texts, strict=True):
        if not text:
            continue
        ranks = draft_ranks(draft, prompt, text)
        found = rounds(runs_from_matches(ranks == 0, depth), depth, ranks)
        total = found if total is None else total + found
    return [round(share, 4) for share in total.top_k] if total else []
