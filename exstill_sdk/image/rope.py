"""Rotary position embedding tables for the reference architecture, with HF transformers'
definitions of each scaling type (default, linear, dynamic, yarn, llama3).

The engine's attention op takes cos/sin tables of shape [positions, head_dim / 2]; these
functions build them once per image. ``rotate`` re-rotates cached keys when StreamingLLM moves
them to new positions.
"""

from __future__ import annotations

import math

import numpy as np

from exstill_sdk.image.arch import DecoderConfig


def inverse_frequencies(arch: DecoderConfig) -> tuple[np.ndarray, float]:
    """(inv_freq [head_dim/2] float64, attention scaling of cos/sin) for the image's rope."""
    dim = arch.head_dim
    base = arch.rope_theta
    rope = arch.rope_scaling
    inv = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = 1.0
    if rope.type == "linear":
        inv = inv / rope.factor
    elif rope.type == "dynamic":
        # HF grows the base once the sequence passes the original length; the card's slot never
        # exceeds max_position_embeddings in practice, so it uses the unscaled frequencies up to
        # it (identical to HF there) and the base HF would use at the slot's length beyond.
        pass
    elif rope.type == "llama3":
        old = rope.original_max_position_embeddings or arch.max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        mid = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, mid, scaled)
    elif rope.type == "yarn":
        old = rope.original_max_position_embeddings or arch.max_position_embeddings
        factor = rope.factor

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low = float(max(math.floor(correction_dim(rope.beta_fast)), 0))
        high = float(min(math.ceil(correction_dim(rope.beta_slow)), dim - 1))
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        inv = (inv / factor) * (1 - extrapolation) + inv * extrapolation
        scaling = rope.attention_factor or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return inv, scaling


def cos_sin_tables(arch: DecoderConfig, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 cos and sin tables [positions, head_dim / 2], computed as HF does (float32
    inverse frequencies, then float32 products)."""
    inv, scaling = inverse_frequencies(arch)
    if arch.rope_scaling.type == "dynamic" and positions > arch.max_position_embeddings:
        factor = arch.rope_scaling.factor
        base = arch.rope_theta * (
            (factor * positions / arch.max_position_embeddings) - (factor - 1)
        ) ** (arch.head_dim / (arch.head_dim - 2))
        inv = 1.0 / (base ** (np.arange(0, arch.head_dim, 2, dtype=np.float64) / arch.head_dim))
    inv32 = inv.astype(np.float32)
    angles = np.arange(positions, dtype=np.float32)[:, None] * inv32[None, :]
    return (
        (np.cos(angles) * scaling).astype(np.float32),
        (np.sin(angles) * scaling).astype(np.float32),
    )


def rotate(keys: np.ndarray, shift: int, inv_freq: np.ndarray) -> np.ndarray:
    """Rotate rotary-embedded keys [..., head_dim] (non-interleaved halves) by ``shift``
    positions: rope(k, p + shift) from rope(k, p)."""
    half = keys.shape[-1] // 2
    angle = shift * inv_freq.astype(np.float64)
    c, s = np.cos(angle), np.sin(angle)
    x1, x2 = keys[..., :half].astype(np.float64), keys[..., half:].astype(np.float64)
    out = np.empty_like(keys)
    out[..., :half] = x1 * c - x2 * s
    out[..., half:] = x2 * c + x1 * s
    return out
