"""Sampling parameters and the one shaping of a distribution from logits, for the host (the
target's p) and the card (the draft's q) alike.

Temperature, then top-k, then top-p, as HF transformers' logits warpers apply them. The tie
rule: top-k keeps every token whose logit is at least the k-th largest, so tokens tied at the
k-th value are all kept (HF's TopKLogitsWarper does the same). Top-p keeps the smallest set of
most likely tokens whose mass reaches ``top_p``, the token that crosses it included; among
equally likely tokens the lower id comes first. Temperature 0 means greedy decoding: the
distribution is then not used, the argmax is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from exstill_sdk.errors import InvalidArgumentError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    """Seeds the acceptance and resampling draws; the same seed, prompts and models give the
    same output."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidArgumentError(f"temperature must be >= 0, not {self.temperature}")
        if self.top_k < 0:
            raise InvalidArgumentError(f"top_k must be >= 0, not {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidArgumentError(f"top_p must be in (0, 1], not {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def shaped_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """p over the vocabulary for each row of ``logits`` [..., V] (float64, rows sum to 1)."""
    scaled = np.asarray(logits, np.float64) / params.temperature
    if params.top_k and params.top_k < scaled.shape[-1]:
        kth = np.partition(scaled, -params.top_k, axis=-1)[..., -params.top_k, None]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    scaled = scaled - scaled.max(-1, keepdims=True)
    p = np.exp(scaled)
    p /= p.sum(-1, keepdims=True)
    if params.top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, -1)
        before = np.cumsum(sorted_p, -1) - sorted_p  # mass of the more likely tokens
        keep_sorted = before < params.top_p
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, -1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(-1, keepdims=True)
    return p
