"""An image's draft model as a HF transformers model (optional: needs the ``hf`` extra).

Used to compare the card's engine with transformers on the same weights (benchmarks, tests)
and to run transformers' own assisted generation with exactly the draft the card runs. int8
images come back with their dequantised weights, f16 widened to f32.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from exstill_sdk.errors import CheckpointError
from exstill_sdk.image.arch import DecoderConfig
from exstill_sdk.image.checkpoint import hf_name
from exstill_sdk.image.quantize import dequantize_rows
from exstill_sdk.image.reader import CardImage


def hf_config(arch: DecoderConfig) -> Any:
    """The transformers config of the family that has exactly this architecture's features."""
    import transformers as tf

    cls: Any
    common: dict[str, Any] = dict(
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        rms_norm_eps=arch.rms_norm_eps,
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tie_embeddings and not arch.head_size,
        hidden_act="silu",
    )
    rope: dict[str, Any] = {"rope_type": arch.rope_scaling.type, "rope_theta": arch.rope_theta}
    if arch.rope_scaling.type != "default":
        rope.update(
            {k: v for k, v in vars(arch.rope_scaling).items() if k != "type" and v},
        )
    if arch.qk_norm:
        if arch.qkv_bias != arch.o_bias:
            raise CheckpointError("q/k norm with q/k/v bias but no o bias has no HF family")
        cls = tf.Qwen3Config
        common["attention_bias"] = arch.qkv_bias
    elif arch.qkv_bias and not arch.o_bias:
        cls = tf.Qwen2Config
    else:
        if arch.qkv_bias != arch.o_bias:
            raise CheckpointError("o bias without q/k/v bias has no HF family")
        cls = tf.LlamaConfig
        common["attention_bias"] = arch.qkv_bias
    config = cls(**common)
    if hasattr(config, "rope_parameters"):
        config.rope_parameters = rope
    else:  # transformers v4
        config.rope_theta = arch.rope_theta
        config.rope_scaling = None if arch.rope_scaling.type == "default" else rope
    return config


def to_hf_model(image: CardImage, attn_implementation: str = "eager") -> Any:
    """A transformers CausalLM holding the image's weights (float32), in eval mode."""
    import torch
    import transformers as tf

    config = hf_config(image.arch)
    config._attn_implementation = attn_implementation
    model = tf.AutoModelForCausalLM.from_config(config)
    state = {}
    for name in image.tensors:
        if name.endswith(".scale"):
            continue
        value = np.asarray(image.tensor(name))
        if value.dtype == np.int8:
            value = dequantize_rows(value, image.tensor(name + ".scale"))
        state[hf_name(name)] = torch.from_numpy(value.astype(np.float32))
    if image.head_ids is not None:
        _spread_head(model, state, image.head_ids)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = model.config.tie_word_embeddings
    missing = [m for m in missing if not (tied and m == "lm_head.weight")]
    if missing or unexpected:
        raise CheckpointError(f"image and HF model disagree: missing {missing}, extra {unexpected}")
    if tied:
        model.tie_weights()
    return model.eval()


def _spread_head(model: Any, state: dict[str, Any], ids: np.ndarray) -> None:
    """A frequency-ranked head as the whole vocabulary's: its rows at their target ids, and
    the other ids' logits set to minus infinity (by a hook on the output projection), as the
    card's graph does (exstill_sdk/execution/graph.py)."""
    import torch

    rows = state["lm_head.weight"]
    full = torch.zeros((model.config.vocab_size, rows.shape[1]), dtype=rows.dtype)
    index = torch.tensor(ids.tolist(), dtype=torch.long)
    full[index] = rows
    state["lm_head.weight"] = full
    absent = torch.full((model.config.vocab_size,), float("-inf"))
    absent[index] = 0.0
    head = model.get_output_embeddings()
    head.register_buffer("absent", absent, persistent=False)  # moves with the model's device
    head.register_forward_hook(lambda m, _i, out: out + m.absent)
