"""Synthetic Llama-family checkpoints for benchmarks: real files (config.json, safetensors,
tokenizer.json) with random weights, written locally; nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from exstill_sdk.errors import InvalidArgumentError


def write_checkpoint(
    directory: Path,
    *,
    layers: int,
    hidden: int,
    intermediate: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    seed: int = 0,
    std: float = 0.02,
) -> Path:
    """An HF Llama checkpoint with random normal weights (``std``) and unit norms."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    head_dim = hidden // heads
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    (directory / "config.json").write_text(json.dumps(config))
    vocab_map = {f"t{i}": i for i in range(vocab)}
    (directory / "tokenizer.json").write_text(
        json.dumps({"model": {"type": "WordLevel", "vocab": vocab_map, "unk_token": "t0"}})
    )
    rng = np.random.default_rng(seed)
    block = (rng.standard_normal(1 << 20) * std).astype(np.float32)

    def filled(*shape: int) -> np.ndarray:
        return np.resize(block, int(np.prod(shape))).reshape(shape)

    q, kv = heads * head_dim, kv_heads * head_dim
    tensors = {
        "model.embed_tokens.weight": filled(vocab, hidden),
        "model.norm.weight": np.ones(hidden, np.float32),
        "lm_head.weight": filled(vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "input_layernorm.weight": np.ones(hidden, np.float32),
                p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
                p + "self_attn.q_proj.weight": filled(q, hidden),
                p + "self_attn.k_proj.weight": filled(kv, hidden),
                p + "self_attn.v_proj.weight": filled(kv, hidden),
                p + "self_attn.o_proj.weight": filled(hidden, q),
                p + "mlp.gate_proj.weight": filled(intermediate, hidden),
                p + "mlp.up_proj.weight": filled(intermediate, hidden),
                p + "mlp.down_proj.weight": filled(hidden, intermediate),
            }
        )
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def synthetic_image(root: Path, spec: str) -> str:
    """A random Llama of LAYERSxHIDDEN (e.g. ``2x256``, vocab 32000) packed as a card image in
    ``root``; its path."""
    from exstill_sdk.image.pack import pack_checkpoint

    try:
        layers, hidden = (int(x) for x in spec.lower().split("x"))
    except ValueError:
        raise InvalidArgumentError(
            f"--synthetic wants LAYERSxHIDDEN, e.g. 2x256, not {spec!r}"
        ) from None
    write_checkpoint(
        root / "ckpt",
        layers=layers,
        hidden=hidden,
        intermediate=hidden * 11 // 4,
        heads=max(1, hidden // 64),
        kv_heads=max(1, hidden // 128),
        vocab=32000,
    )
    path = str(root / "draft.img")
    pack_checkpoint(root / "ckpt", path, f"synthetic-{spec}")
    return path


def image_or_synthetic(root: Path, image_path: str | None, synthetic: str | None, what: str) -> str:
    """The benchmark's image: a synthetic LAYERSxHIDDEN Llama packed into ``root`` when one is
    asked for, else ``image_path``; ``what`` names the image in the error when neither is."""
    if synthetic:
        return synthetic_image(root, synthetic)
    if image_path is None:
        raise InvalidArgumentError(f"give {what} or --synthetic LAYERSxHIDDEN")
    return image_path
