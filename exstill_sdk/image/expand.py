"""Function-preserving expansion of a card image: the same model, made wider.

Why: what decides whether speculative decoding pays is the target's *regime*, the cost of
scoring K+1 tokens against one plain step. A target whose weights fit in the CPU's cache is
bound by arithmetic (7 tokens cost about 2.4 steps); one whose weights stream from memory, like
a large LLM on a GPU, verifies 7 tokens for well under 2 steps. Expanding a small trained model
gives a target of any size that writes exactly the small model's text, so a draft distilled from
the small one stays aligned with it: a cost stand-in for a large target.

How (every step exact in real arithmetic; only float rounding differs):

1. Fold each RMSNorm gain into the matrices that read the normalised vector, so every norm
   has unit gain.
2. Widen the residual stream from d to D: x' = E x, where E (D x d) has orthonormal columns (the
   first d columns of a fixed random orthogonal matrix). Then |x'| = |x|, so RMSNorm over D
   dimensions gives sqrt(D/d) E norm(x) once its eps is scaled by d/D; the matrices that read the
   normalised stream are multiplied by sqrt(d/D) E^T, the ones that write to it (attention's
   output, the MLP's down projection, the embedding) by E. Every result matrix is dense.
3. Split attention heads: each key/value head becomes n copies with the same keys and values
   split into n random parts that sum to the original; each copy carries the original group's
   query heads, and the output projection reads every copy with the original columns. The
   outputs of the copies add up to the original head's output.
4. Split MLP units the same way: a unit silu(g.x) (u.x) becomes n units with the same gate row
   and up rows that sum to u, each written back with the original down column.

The untied output projection is the embedding with the final norm's gain folded in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from exstill_sdk.errors import ImageError
from exstill_sdk.image.arch import DecoderConfig
from exstill_sdk.image.format import DType
from exstill_sdk.image.reader import CardImage
from exstill_sdk.image.writer import ImageWriter, TensorSpec, WrittenImage

SPLIT_SPREAD = 0.5
"""Scale of the zero-sum noise that makes split parts differ, relative to a row's RMS."""


@dataclass(frozen=True)
class Widths:
    """The expanded model's widths; heads are 64 wide, as in the source."""

    hidden_size: int
    num_kv_heads: int
    intermediate_size: int

    @classmethod
    def scaled(cls, source: DecoderConfig, hidden_size: int) -> Widths:
        """Widths in the source's proportions for a residual stream of ``hidden_size``: query
        width equal to it, the source's grouping of queries per key/value head, and the source's
        MLP ratio."""
        group = source.num_heads // source.num_kv_heads
        kv = max(source.num_kv_heads, round(hidden_size / (source.head_dim * group)))
        ratio = source.intermediate_size / source.hidden_size
        return cls(hidden_size, kv, max(source.intermediate_size, round(hidden_size * ratio)))


def expanded_config(source: DecoderConfig, widths: Widths) -> DecoderConfig:
    """The architecture of ``source`` expanded to ``widths``."""
    if widths.hidden_size < source.hidden_size:
        raise ValueError(
            f"hidden size {widths.hidden_size} is below the source's {source.hidden_size}"
        )
    if widths.num_kv_heads < source.num_kv_heads:
        raise ValueError(f"{widths.num_kv_heads} key/value heads is below the source's")
    if widths.intermediate_size < source.intermediate_size:
        raise ValueError(f"MLP width {widths.intermediate_size} is below the source's")
    group = source.num_heads // source.num_kv_heads
    return replace(
        source,
        hidden_size=widths.hidden_size,
        num_heads=widths.num_kv_heads * group,
        num_kv_heads=widths.num_kv_heads,
        intermediate_size=widths.intermediate_size,
        rms_norm_eps=source.rms_norm_eps * source.hidden_size / widths.hidden_size,
        tie_embeddings=False,
    )


def parameter_count(config: DecoderConfig) -> int:
    return sum(math.prod(shape) for shape in config.tensor_shapes().values())


def _copies(source: int, target: int) -> np.ndarray:
    """For each of ``target`` new units, the source unit it comes from (contiguous, balanced)."""
    return (np.arange(target) * source) // target


def _split_rows(rows: np.ndarray, origin: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """New rows ``out[i]`` that sum, over every i with the same ``origin[i]``, to
    ``rows[origin[i]]``: each an equal share plus zero-sum noise of the row's scale."""
    counts = np.bincount(origin, minlength=rows.shape[0])[origin]
    out = rows[origin] / counts[:, None]
    scale = SPLIT_SPREAD * np.sqrt(np.mean(rows[origin] ** 2, axis=1, keepdims=True))
    noise = rng.standard_normal(out.shape) * scale
    sums = np.zeros_like(rows)
    np.add.at(sums, origin, noise)
    noise -= (sums / np.bincount(origin, minlength=rows.shape[0])[:, None])[origin]
    return out + noise


def _check_source(config: DecoderConfig) -> None:
    if config.qkv_bias or config.o_bias:
        raise ImageError("expansion supports targets without attention biases")


def expanded_tensors(
    image: CardImage, widths: Widths, seed: int = 0
) -> Iterator[tuple[str, np.ndarray]]:
    """The expanded model's f32 tensors in file order, each computed when the iteration
    reaches it (one layer's matrices in memory at a time)."""
    src = image.arch
    _check_source(src)
    cfg = expanded_config(src, widths)
    d, big = src.hidden_size, cfg.hidden_size
    hd, group = src.head_dim, src.num_heads // src.num_kv_heads
    rng = np.random.default_rng(seed)
    basis, _ = np.linalg.qr(rng.standard_normal((big, d)))
    embed_t = basis.T.astype(np.float32)  # d x D: x' = x @ embed_t
    read = math.sqrt(d / big)

    def get(name: str) -> np.ndarray:
        return np.asarray(image.tensor(name), dtype=np.float64)

    kv_origin = _copies(src.num_kv_heads, cfg.num_kv_heads)
    q_origin = (kv_origin[:, None] * group + np.arange(group)).reshape(-1)
    unit_origin = _copies(src.intermediate_size, cfg.intermediate_size)

    def head_rows(origin: np.ndarray) -> np.ndarray:
        return (origin[:, None] * hd + np.arange(hd)).reshape(-1)

    q_rows, kv_rows = head_rows(q_origin), head_rows(kv_origin)

    def reader(w: np.ndarray, gain: np.ndarray) -> np.ndarray:
        """A matrix that reads the normalised residual stream."""
        return ((w * (gain * read)).astype(np.float32)) @ embed_t

    def writer(w: np.ndarray) -> np.ndarray:
        """A matrix that writes to the residual stream."""
        return np.ascontiguousarray((w.astype(np.float32).T @ embed_t).T)

    ones = np.ones(big, np.float32)  # every norm's gain is folded into what reads it
    yield "embed.weight", get("embed.weight").astype(np.float32) @ embed_t
    for layer in range(src.num_layers):
        p = f"layers.{layer}."
        rng = np.random.default_rng([seed, layer])
        attn_gain, mlp_gain = get(p + "attn_norm.weight"), get(p + "mlp_norm.weight")
        yield p + "attn_norm.weight", ones
        yield p + "attn.q.weight", reader(get(p + "attn.q.weight")[q_rows], attn_gain)
        yield p + "attn.k.weight", reader(get(p + "attn.k.weight")[kv_rows], attn_gain)
        heads = get(p + "attn.v.weight").reshape(src.num_kv_heads, hd * d)
        yield (
            p + "attn.v.weight",
            reader(_split_rows(heads, kv_origin, rng).reshape(-1, d), attn_gain),
        )
        if src.qk_norm:
            yield p + "attn.q_norm.weight", get(p + "attn.q_norm.weight").astype(np.float32)
            yield p + "attn.k_norm.weight", get(p + "attn.k_norm.weight").astype(np.float32)
        yield p + "attn.o.weight", writer(get(p + "attn.o.weight")[:, q_rows])
        yield p + "mlp_norm.weight", ones
        yield p + "mlp.gate.weight", reader(get(p + "mlp.gate.weight")[unit_origin], mlp_gain)
        up = _split_rows(get(p + "mlp.up.weight"), unit_origin, rng)
        yield p + "mlp.up.weight", reader(up, mlp_gain)
        yield p + "mlp.down.weight", writer(get(p + "mlp.down.weight")[:, unit_origin])
    yield "norm.weight", ones
    head = "embed.weight" if src.tie_embeddings else "lm_head.weight"
    yield "lm_head.weight", reader(get(head), get("norm.weight"))


def expand_image(
    image: CardImage,
    output: str | Path,
    widths: Widths,
    *,
    target: str,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> WrittenImage:
    """Write ``image`` expanded to ``widths`` as an f32 image named ``target``, with the
    source's tokenizer identity. ``progress`` receives the bytes written as they are."""
    cfg = expanded_config(image.arch, widths)
    shapes = cfg.tensor_shapes()
    specs = [TensorSpec(name, DType.F32, shape) for name, shape in shapes.items()]
    metadata: dict[str, Any] = {
        key: value
        for key, value in image.metadata.items()
        if not key.startswith(("arch.", "quant.", "image."))
    }
    metadata.update(
        {
            "image.target": target,
            "image.version": str(image.metadata.get("image.version", "1")),
            "image.created_by": (
                f"exstill_sdk.image.expand from {image.metadata.get('image.target')!s} "
                f"(digest {image.content_sha256.hex()[:16]}..., seed {seed})"
            ),
            "quant.dtype": "f32",
            **cfg.to_metadata(),
        }
    )
    with ImageWriter(output, metadata, specs) as out:
        for name, array in expanded_tensors(image, widths, seed):
            if array.shape != shapes[name]:  # a bug here must never write a wrong image
                raise AssertionError(f"{name}: {array.shape} != {shapes[name]}")
            out.write(name, np.ascontiguousarray(array, dtype=np.float32))
            if progress is not None:
                progress(array.nbytes)
        return out.finish()
