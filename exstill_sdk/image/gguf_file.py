"""Reading GGUF files (llama.cpp's format) as the card's reference architecture.

A GGUF file carries the model's hyperparameters (``<arch>.*`` keys), its tokenizer
(``tokenizer.ggml.*``) and its tensors, often in llama.cpp's block-quantised formats (Q4_1,
Q8_0, K-quants ...). The ``gguf`` package, llama.cpp's own reader, maps the file and
dequantises each tensor to float32; the image then stores it in the dtype ``exstill-pack`` is
asked for. Two conversions undo what llama.cpp's converter did:

- names: ``blk.N.attn_q.weight`` and the like become the image's names (``_LAYER_NAMES``);
- Llama's q and k rows: the converter interleaves each head's two rotary halves (its
  ``permute``) because llama.cpp rotates adjacent pairs; the card rotates halves as HF does, so
  those rows are put back in HF's order.

The tokenizer's identity is computed from ``tokenizer.ggml.tokens`` as from a tokenizer.json's
vocabulary: the same strings at the same ids, with the converter's ``[PAD<i>]`` fillers (type
UNUSED) as unused ids, and those past its last token dropped. Llama 3's frequency table
(``rope_freqs.weight``) and rope scalings other than linear are refused with a message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from exstill_sdk.errors import CheckpointError
from exstill_sdk.image.arch import DecoderConfig, RopeScaling
from exstill_sdk.image.checkpoint import arrange_tensors
from exstill_sdk.image.tokenizer import TokenizerFingerprint, fingerprint_tokens

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")
_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "mlp_norm.weight",
    "attn_q.weight": "attn.q.weight",
    "attn_k.weight": "attn.k.weight",
    "attn_v.weight": "attn.v.weight",
    "attn_output.weight": "attn.o.weight",
    "attn_q.bias": "attn.q.bias",
    "attn_k.bias": "attn.k.bias",
    "attn_v.bias": "attn.v.bias",
    "attn_output.bias": "attn.o.bias",
    "attn_q_norm.weight": "attn.q_norm.weight",
    "attn_k_norm.weight": "attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate.weight",
    "ffn_up.weight": "mlp.up.weight",
    "ffn_down.weight": "mlp.down.weight",
}
_FIXED_NAMES = {
    "token_embd.weight": "embed.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_UNUSED_TOKEN_TYPE = 5  # llama.cpp's TokenType.UNUSED
_SPECIAL_KEYS = {
    "bos": "bos_token_id",
    "eos": "eos_token_id",
    "unk": "unknown_token_id",
    "pad": "padding_token_id",
}


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a file that starts with GGUF's magic."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def image_name(gguf_name: str) -> str | None:
    """The image tensor name for a GGUF tensor name; None for names outside the mapping."""
    if gguf_name in _FIXED_NAMES:
        return _FIXED_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        mapped = _LAYER_NAMES.get(parts[2])
        return f"layers.{parts[1]}.{mapped}" if mapped else None
    return None


def unpermute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """HF's row order of a Llama q or k matrix (or bias) that llama.cpp's converter permuted:
    within each head, rows ``[a0, b0, a1, b1, ...]`` go back to ``[a0, a1, ..., b0, b1, ...]``."""
    rows = weight.shape[0]
    shaped = weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
    return shaped.swapaxes(1, 2).reshape(weight.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _f32(value: Any) -> float:
    """A float GGUF stored as float32, as the decimal it was written from (1e-05, not
    9.999999747378752e-06): the shortest repr that rounds to the same float32."""
    return float(str(np.float32(value)))


def _rope(reader: Any, arch: str) -> RopeScaling:
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    if kind in ("none", None):
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(
            type="linear", factor=float(_field(reader, f"{arch}.rope.scaling.factor"))
        )
    raise CheckpointError(
        f"rope scaling {kind!r} in a GGUF file is not supported; pack the model's HF checkpoint"
    )


def gguf_config(reader: Any, tensor_names: set[str]) -> DecoderConfig:
    """The reference architecture a GGUF file's metadata declares."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise CheckpointError(
            f"GGUF architecture {arch!r} is not supported; exstill-pack reads "
            f"{', '.join(SUPPORTED_ARCHS)} GGUF files"
        )
    if "rope_freqs.weight" in tensor_names:
        raise CheckpointError(
            "this GGUF file has Llama 3 rope frequencies (rope_freqs.weight), which exstill-pack "
            "does not read from GGUF; pack the model's HF checkpoint"
        )

    def need(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise CheckpointError(f"the GGUF file lacks {arch}.{key}")
        return value

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    try:
        return DecoderConfig(
            vocab_size=int(_field(reader, f"{arch}.vocab_size", len(tokens))),
            hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")),
            num_layers=int(need("block_count")),
            num_heads=heads,
            num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
            head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
            rms_norm_eps=_f32(need("attention.layer_norm_rms_epsilon")),
            rope_theta=_f32(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
            rope_scaling=_rope(reader, arch),
            max_position_embeddings=int(_field(reader, f"{arch}.context_length", 4096)),
            qk_norm=arch == "qwen3",
            qkv_bias="blk.0.attn_q.bias" in tensor_names,
            o_bias="blk.0.attn_output.bias" in tensor_names,
            tie_embeddings="output.weight" not in tensor_names,
            source=arch,
        )
    except ValueError as exc:
        raise CheckpointError(f"GGUF metadata: {exc}") from None


def gguf_fingerprint(reader: Any) -> TokenizerFingerprint:
    """The tokenizer identity of a GGUF file: the same value exstill-pack computes from the
    model's tokenizer.json."""
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise CheckpointError(
            "the GGUF file carries no tokenizer (tokenizer.ggml.tokens): the image must carry "
            "the target's tokenizer identity"
        )
    types = _field(reader, "tokenizer.ggml.token_type") or []
    listed: list[str | None] = [
        None if i < len(types) and types[i] == _UNUSED_TOKEN_TYPE and t == f"[PAD{i}]" else t
        for i, t in enumerate(tokens)
    ]
    while listed and listed[-1] is None:  # ids past the tokenizer's last are not its own
        listed.pop()
    specials = {}
    for name, key in _SPECIAL_KEYS.items():
        value = _field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            specials[name] = [int(value)]
    return fingerprint_tokens(listed, specials)


@dataclass
class GgufCheckpoint:
    path: Path
    config: DecoderConfig
    tokenizer: TokenizerFingerprint
    tensors: dict[str, Any]
    """By image name, in the architecture's order: the reader's tensor records."""

    def load(self) -> Iterator[tuple[str, Callable[[], np.ndarray]]]:
        """(image name, loader) pairs; each loader dequantises one tensor to float32 (float16
        stays float16) in HF's layout."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        permuted = self.config.source == "llama"
        shapes = self.config.tensor_shapes()

        def loader(name: str, tensor: Any) -> Callable[[], np.ndarray]:
            def load() -> np.ndarray:
                kind = GGMLQuantizationType(tensor.tensor_type)
                if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                    value = np.asarray(tensor.data)
                else:
                    value = dequantize(tensor.data, kind)
                value = value.reshape(shapes[name])
                if permuted and name.endswith(("attn.q.weight", "attn.q.bias")):
                    value = unpermute_rows(value, self.config.num_heads)
                elif permuted and name.endswith(("attn.k.weight", "attn.k.bias")):
                    value = unpermute_rows(value, self.config.num_kv_heads)
                return value

            return load

        for name, tensor in self.tensors.items():
            yield name, loader(name, tensor)


def read_gguf(path: str | Path) -> GgufCheckpoint:
    """Plan the conversion of a GGUF file: its architecture, tokenizer identity and tensors."""
    try:
        from gguf import GGUFReader
    except ImportError:  # a core dependency; a broken install
        raise CheckpointError("reading GGUF needs the gguf package: pip install gguf") from None
    path = Path(path)
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError, KeyError, IndexError) as exc:
        raise CheckpointError(f"{path} is not a readable GGUF file: {exc}") from None
    by_name = {t.name: t for t in reader.tensors}
    config = gguf_config(reader, set(by_name))
    fingerprint = gguf_fingerprint(reader)
    if fingerprint.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"the GGUF tokenizer defines ids up to {fingerprint.vocab_size - 1}, but the model "
            f"has {config.vocab_size} vocabulary rows"
        )
    found: dict[str, Any] = {}
    unknown = []
    for gguf_name, tensor in by_name.items():
        name = image_name(gguf_name)
        if name is None:
            unknown.append(gguf_name)
        else:
            found[name] = tensor
    ordered = arrange_tensors(
        config,
        found,
        unknown,
        # GGUF lists dimensions innermost first: [in, out] for a matrix
        lambda t: (t.name, tuple(int(d) for d in reversed(t.shape))),
        "the GGUF metadata",
    )
    return GgufCheckpoint(path, config, fingerprint, ordered)
