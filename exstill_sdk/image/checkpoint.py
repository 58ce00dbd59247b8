"""Reading HF checkpoints (Llama, Mistral, Qwen2, Qwen3) as the card's reference architecture.

A checkpoint directory holds config.json, model.safetensors (or shards with
model.safetensors.index.json) and tokenizer.json. The safetensors library opens and validates
each file (it parses without executing anything) and lists names, dtypes and shapes; tensor
data is then taken as numpy views of a read-only map of the file at the offsets the format's
header gives, so packing copies each byte once, from the page cache into the image. Tensors are
mapped to image names and never transposed: the image keeps torch.nn.Linear's [out, in] layout
(see arch.py). bfloat16 is widened to float32 exactly (its bits are the high half of a float32).
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from safetensors import safe_open

from exstill_sdk.errors import CheckpointError
from exstill_sdk.image.arch import ROPE_TYPES, DecoderConfig, RopeScaling
from exstill_sdk.image.tokenizer import (
    TokenizerFingerprint,
    fingerprint_tokens,
    special_ids_from_checkpoint,
    tokenizer_json_vocab,
)

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
T = TypeVar("T")
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "self_attn.q_proj.weight": "attn.q.weight",
    "self_attn.k_proj.weight": "attn.k.weight",
    "self_attn.v_proj.weight": "attn.v.weight",
    "self_attn.o_proj.weight": "attn.o.weight",
    "self_attn.q_proj.bias": "attn.q.bias",
    "self_attn.k_proj.bias": "attn.k.bias",
    "self_attn.v_proj.bias": "attn.v.bias",
    "self_attn.o_proj.bias": "attn.o.bias",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "mlp.gate_proj.weight": "mlp.gate.weight",
    "mlp.up_proj.weight": "mlp.up.weight",
    "mlp.down_proj.weight": "mlp.down.weight",
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def image_name(hf_name: str) -> str | None:
    """The image tensor name for an HF parameter name; None for names outside the mapping."""
    if hf_name == "model.embed_tokens.weight":
        return "embed.weight"
    if hf_name == "model.norm.weight":
        return "norm.weight"
    if hf_name == "lm_head.weight":
        return "lm_head.weight"
    parts = hf_name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        mapped = _LAYER_NAMES.get(parts[3])
        return f"layers.{parts[2]}.{mapped}" if mapped else None
    return None


_HF_LAYER_NAMES = {v: k for k, v in _LAYER_NAMES.items()}


def hf_name(name: str) -> str:
    """The HF parameter name of an image tensor name (the inverse of ``image_name``)."""
    fixed = {
        "embed.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight",
    }
    if name in fixed:
        return fixed[name]
    _, layer, rest = name.split(".", 2)
    return f"model.layers.{layer}.{_HF_LAYER_NAMES[rest]}"


def _rope(config: Mapping[str, Any]) -> tuple[float, RopeScaling]:
    """rope_theta and scaling from a v4 (rope_theta + rope_scaling) or v5 (rope_parameters)
    config."""
    if config.get("rope_parameters"):  # transformers v5
        merged = dict(config["rope_parameters"])
    else:  # v4: rope_theta beside an optional rope_scaling
        merged = dict(config.get("rope_scaling") or {})
    theta = merged.pop("rope_theta", config.get("rope_theta", 10000.0))
    kind = merged.pop("rope_type", merged.pop("type", "default")) or "default"
    if kind not in ROPE_TYPES:
        raise CheckpointError(
            f"rope scaling {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    fields = {
        "factor": float,
        "original_max_position_embeddings": int,
        "low_freq_factor": float,
        "high_freq_factor": float,
        "beta_fast": float,
        "beta_slow": float,
        "attention_factor": float,
    }
    values = {k: t(merged[k]) for k, t in fields.items() if merged.get(k) is not None}
    return float(theta), RopeScaling(type=kind, **values)


def decoder_config(config: Mapping[str, Any]) -> DecoderConfig:
    """The reference architecture of an HF config.json; CheckpointError for what the card
    cannot run, naming what is supported."""
    family = config.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise CheckpointError(
            f"model_type {family!r} is not supported; exstill-pack reads "
            f"{', '.join(SUPPORTED_FAMILIES)} checkpoints"
        )
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"hidden_act {act!r} is not supported; the card runs SwiGLU (silu)")
    if config.get("mlp_bias"):
        raise CheckpointError("mlp_bias=true is not supported by the card's architecture")
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    attention_bias = bool(config.get("attention_bias", False))
    sliding = config.get("sliding_window") or 0
    if family in ("qwen2", "qwen3") and not config.get("use_sliding_window", False):
        sliding = 0
    theta, rope = _rope(config)
    try:
        return DecoderConfig(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope,
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            qk_norm=family == "qwen3",
            qkv_bias=family == "qwen2" or (family in ("llama", "qwen3") and attention_bias),
            o_bias=family in ("llama", "qwen3") and attention_bias,
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            sliding_window=int(sliding),
            source=family,
        )
    except KeyError as exc:
        raise CheckpointError(f"config.json lacks {exc.args[0]!r}") from None
    except ValueError as exc:
        raise CheckpointError(f"config.json: {exc}") from None


@dataclass(frozen=True)
class SourceTensor:
    file: Path
    hf_name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    """Absolute byte offset of the data in ``file``."""


_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}
_NUMPY: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # read as raw bits, then widened
}


def _data_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """Absolute (begin, end) of every tensor's data, from the safetensors header: an 8-byte
    little-endian length N, then N bytes of JSON whose ``data_offsets`` count from byte 8+N.
    The library has already validated the file when this runs."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {
        name: (8 + n + entry["data_offsets"][0], 8 + n + entry["data_offsets"][1])
        for name, entry in header.items()
        if name != "__metadata__"
    }


@dataclass
class Checkpoint:
    directory: Path
    config: DecoderConfig
    tokenizer: TokenizerFingerprint
    tensors: dict[str, SourceTensor]
    """By image name, in the architecture's order."""

    def load(self) -> Iterator[tuple[str, Callable[[], np.ndarray]]]:
        """(image name, loader) pairs in file order; each loader returns a float32 or float16
        array (a view of the mapped file, except for widened bfloat16)."""
        maps: dict[Path, mmap.mmap] = {}

        def loader(src: SourceTensor) -> Callable[[], np.ndarray]:
            def load() -> np.ndarray:
                if src.file not in maps:
                    with open(src.file, "rb") as f:
                        maps[src.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                count = int(np.prod(src.shape, dtype=np.int64))
                raw = np.frombuffer(maps[src.file], _NUMPY[src.dtype], count, src.offset)
                if src.dtype == "BF16":
                    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(src.shape)
                return raw.reshape(src.shape)

            return load

        for name, src in self.tensors.items():
            yield name, loader(src)


def arrange_tensors(
    config: DecoderConfig,
    found: Mapping[str, T],
    unknown: Sequence[str],
    describe: Callable[[T], tuple[str, tuple[int, ...]]],
    declared_by: str,
) -> dict[str, T]:
    """The source's tensors (by image name) in the architecture's order, or a CheckpointError
    for one it has no place for (``unknown``, source names), lacks, or finds misshapen.
    ``describe`` gives a tensor's source name and shape in HF's [out, in] order."""
    if unknown:
        raise CheckpointError(
            f"tensors the card's architecture has no place for: {', '.join(unknown[:5])}"
        )
    ordered: dict[str, T] = {}
    for name, shape in config.tensor_shapes().items():
        src = found.get(name)
        if src is None:
            raise CheckpointError(f"the source lacks the tensor for {name!r}")
        source_name, source_shape = describe(src)
        if source_shape != shape:
            raise CheckpointError(
                f"{source_name} has shape {list(source_shape)}; {declared_by} implies {list(shape)}"
            )
        ordered[name] = src
    extra = set(found) - set(ordered)
    if extra:
        raise CheckpointError(f"tensors {declared_by} does not account for: {sorted(extra)[:5]}")
    return ordered


def _shards(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index, "a safetensors index").get("weight_map") or {}
        files = sorted({directory / f for f in weight_map.values()})
        if not files:
            raise CheckpointError(f"{index} maps no tensors")
        return files
    single = directory / "model.safetensors"
    if single.exists():
        return [single]
    if list(directory.glob("*.bin")) or list(directory.glob("*.pt")):
        raise CheckpointError(
            f"{directory} holds pickled PyTorch weights; exstill-pack reads only safetensors "
            "(re-save with save_pretrained(..., safe_serialization=True))"
        )
    raise CheckpointError(f"{directory} has no model.safetensors or model.safetensors.index.json")


def _read_json(path: Path, what: str) -> Any:
    """A checkpoint's JSON file, or a CheckpointError that names the file and what it must be."""
    try:
        return json.loads(path.read_text("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        where = (
            f" (line {exc.lineno}, column {exc.colno})"
            if isinstance(exc, json.JSONDecodeError)
            else ""
        )
        raise CheckpointError(f"{path} is not JSON{where}: it must be {what}") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror}") from None


def read_checkpoint(directory: str | Path, tokenizer: str | Path | None = None) -> Checkpoint:
    """Plan the conversion of a checkpoint: its architecture, tokenizer identity and tensors.
    ``tokenizer`` points at the target's tokenizer.json when the checkpoint lacks one."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(
            f"{directory}: no such directory; give an HF checkpoint directory (config.json, "
            "safetensors, tokenizer.json)"
        )
    config_path = directory / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{directory} has no config.json: is it an HF checkpoint directory?")
    config = decoder_config(_read_json(config_path, "the model's HF config"))
    tok_path = Path(tokenizer) if tokenizer else directory / "tokenizer.json"
    if not tok_path.exists():
        raise CheckpointError(
            f"no tokenizer at {tok_path}: the image must carry the target's tokenizer identity; "
            "pass --tokenizer PATH/tokenizer.json"
        )
    tokenizer_json = _read_json(tok_path, "an HF tokenizer.json")
    try:
        tokens = tokenizer_json_vocab(tokenizer_json)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{tok_path}: {exc}") from None
    fingerprint = fingerprint_tokens(
        tokens, special_ids_from_checkpoint(tok_path.parent if tokenizer else directory, tokens)
    )
    if fingerprint.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"{tok_path} defines ids up to {fingerprint.vocab_size - 1}, but the model has "
            f"{config.vocab_size} vocabulary rows: it is not this model's tokenizer"
        )

    found: dict[str, SourceTensor] = {}
    unknown = []
    for path in _shards(directory):
        try:
            with safe_open(path, "numpy") as f:
                listed = [
                    (n, f.get_slice(n).get_dtype(), tuple(f.get_slice(n).get_shape()))
                    for n in f.keys()  # noqa: SIM118 - safe_open is not a mapping
                ]
        except Exception as exc:  # the library's own error types vary by version
            raise CheckpointError(f"{path.name} is not a valid safetensors file: {exc}") from None
        offsets = _data_offsets(path)
        for hf_name, dtype, shape in listed:
            name = image_name(hf_name)
            if name is None:
                if not hf_name.endswith(_IGNORED_SUFFIXES):
                    unknown.append(hf_name)
                continue
            if name == "lm_head.weight" and config.tie_embeddings:
                continue  # some tied checkpoints also save the shared matrix
            if dtype not in _ITEMSIZE:
                raise CheckpointError(f"{hf_name} is {dtype}; expected F32, F16 or BF16")
            begin, end = offsets[hf_name]
            if end - begin != _ITEMSIZE[dtype] * int(np.prod(shape, dtype=object)):
                raise CheckpointError(f"{hf_name}: its data size does not match its shape")
            found[name] = SourceTensor(path, hf_name, dtype, shape, begin)
    ordered = arrange_tensors(
        config, found, unknown, lambda src: (src.hf_name, src.shape), "config.json"
    )
    return Checkpoint(directory, config, fingerprint, ordered)
