"""The card's reference architecture, ``exstill-decoder-v1``: what every draft model on the card
is, whatever family its weights came from.

A decoder-only transformer: token embedding; per layer, RMSNorm -> grouped-query attention with
rotary position embeddings (optional q/k/v/o biases, optional per-head RMSNorm of q and k as in
Qwen3) -> residual, RMSNorm -> SwiGLU MLP (down(silu(gate(x)) * up(x))) -> residual; final
RMSNorm; output projection, or the embedding itself when tied. Its hyperparameters live in the
image metadata under ``arch.*``; tensor names and shapes are given by ``tensor_shapes``.

Matrices are stored as torch.nn.Linear stores them, ``[out_features, in_features]``, and the
embedding and output projection as ``[vocab, hidden]``: the engine multiplies by the transpose
(ONNX Gemm with transB, or MatMulNBits for int8), so packing never transposes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from exstill_sdk.errors import ImageError

ARCH_NAME = "exstill-decoder-v1"
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary embedding frequency scaling, with HF's meaning of each field."""

    type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 0.0
    """yarn: multiplier of the attention logits' scale; 0 means HF's default for the factor."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if str(f.type) == "float" and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, f.name, float(value))
        if self.type not in ROPE_TYPES:
            raise ValueError(
                f"rope scaling {self.type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
            )


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 4096
    qk_norm: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    tie_embeddings: bool = False
    sliding_window: int = 0
    """0: full attention. Otherwise the source model's window (the engine may honour it)."""
    source: str = ""
    """The checkpoint family it was packed from (llama, mistral, qwen2, qwen3)."""
    head_size: int = 0
    """0: the output projection covers the whole vocabulary. Otherwise a frequency-ranked head
    (FR-Spec): ``lm_head.weight`` holds this many rows, for the target ids the image lists in
    metadata ``head.ids``; the draft never proposes another token (the target still verifies
    every one, so output is unchanged)."""

    def __post_init__(self) -> None:
        for name in ("rms_norm_eps", "rope_theta"):  # accept ints where floats are meant
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, name, float(value))
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or not 1 <= value <= 1 << 24:
                raise ValueError(f"{name} must be an integer in 1..2**24, not {value!r}")
        if not isinstance(self.head_size, int) or not 0 <= self.head_size <= self.vocab_size:
            raise ValueError(f"head_size must be 0..vocab_size, not {self.head_size!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not (isinstance(value, float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive finite number, not {value!r}")

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the architecture, by image name, in file order."""
        h, hd = self.hidden_size, self.head_dim
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        out: dict[str, tuple[int, ...]] = {"embed.weight": (self.vocab_size, h)}
        for i in range(self.num_layers):
            p = f"layers.{i}."
            out[p + "attn_norm.weight"] = (h,)
            out[p + "attn.q.weight"] = (q, h)
            out[p + "attn.k.weight"] = (kv, h)
            out[p + "attn.v.weight"] = (kv, h)
            if self.qkv_bias:
                out[p + "attn.q.bias"] = (q,)
                out[p + "attn.k.bias"] = (kv,)
                out[p + "attn.v.bias"] = (kv,)
            if self.qk_norm:
                out[p + "attn.q_norm.weight"] = (hd,)
                out[p + "attn.k_norm.weight"] = (hd,)
            out[p + "attn.o.weight"] = (h, q)
            if self.o_bias:
                out[p + "attn.o.bias"] = (h,)
            out[p + "mlp_norm.weight"] = (h,)
            out[p + "mlp.gate.weight"] = (self.intermediate_size, h)
            out[p + "mlp.up.weight"] = (self.intermediate_size, h)
            out[p + "mlp.down.weight"] = (h, self.intermediate_size)
        out["norm.weight"] = (h,)
        if self.head_size:
            out["lm_head.weight"] = (self.head_size, h)
        elif not self.tie_embeddings:
            out["lm_head.weight"] = (self.vocab_size, h)
        return out

    def to_metadata(self) -> dict[str, Any]:
        out: dict[str, Any] = {"arch.name": ARCH_NAME}
        for f in fields(self):
            if f.name == "head_size" and not self.head_size:
                continue  # images with a whole-vocabulary head stay as they were
            if f.name == "rope_scaling":
                for key, value in asdict(self.rope_scaling).items():
                    out[f"arch.rope_scaling.{key}"] = value
            else:
                out[f"arch.{f.name}"] = getattr(self, f.name)
        return out

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> DecoderConfig:
        """The architecture an image declares; ImageError names a missing or bad key."""
        name = meta.get("arch.name")
        if name != ARCH_NAME:
            raise ImageError(
                f"architecture {name!r} is not supported by this SDK (it supports {ARCH_NAME})"
            )

        def pick(prefix: str, spec: type) -> dict[str, Any]:
            values = {}
            for f in fields(spec):
                key = f"{prefix}{f.name}"
                if f.name == "rope_scaling":
                    continue
                if key not in meta:
                    if f.default is not f.default_factory:  # has a default: optional key
                        continue
                    raise ImageError(f"metadata lacks {key!r}")
                value = meta[key]
                wanted = {"int": int, "float": float, "bool": bool, "str": str}[str(f.type)]
                if wanted is float and isinstance(value, int) and not isinstance(value, bool):
                    value = float(value)
                if type(value) is not wanted:
                    raise ImageError(f"metadata {key!r} must be {wanted.__name__}, not {value!r}")
                values[f.name] = value
            return values

        try:
            rope = RopeScaling(**pick("arch.rope_scaling.", RopeScaling))
            return cls(**pick("arch.", cls), rope_scaling=rope)
        except (TypeError, ValueError) as exc:
            raise ImageError(f"metadata arch.*: {exc}") from None
