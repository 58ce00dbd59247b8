"""Tiny GGUF files written from the tests' tiny HF checkpoints as llama.cpp's converter
(convert_hf_to_gguf.py) writes them: its tensor names, its metadata keys, Llama's q/k rows
permuted for llama.cpp's rotary layout, and matrices in the block format asked for."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _gguf_name(hf_name: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_NAMES[rest]}"


def save_gguf(checkpoint: Path, path: Path, matrices: str = "F32", pad_to: int = 0) -> Path:
    """Write the HF checkpoint directory as a GGUF file; ``matrices`` is a GGML type name
    (F32, F16, Q8_0, Q4_1 ...) for 2-D tensors (vectors stay F32, as llama.cpp keeps norms).
    ``pad_to`` pads the token list with the converter's ``[PAD<i>]`` fillers."""
    import gguf

    config = json.loads((checkpoint / "config.json").read_text())
    arch = config["model_type"]
    arch = "llama" if arch == "mistral" else arch
    tok = json.loads((checkpoint / "tokenizer.json").read_text())
    vocab = {**tok["model"]["vocab"], **{a["content"]: a["id"] for a in tok["added_tokens"]}}
    tokens = [""] * max(vocab.values()) + [""]
    for text, i in vocab.items():
        tokens[i] = text
    types = [gguf.TokenType.NORMAL] * len(tokens)
    for i in range(len(tokens), pad_to):
        tokens.append(f"[PAD{i}]")
        types.append(gguf.TokenType.UNUSED)

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    kind = gguf.GGMLQuantizationType[matrices]
    for hf_name, value in load_file(checkpoint / "model.safetensors").items():
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            value = llama_cpp_permute(value, heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            value = llama_cpp_permute(value, kv_heads)
        value = value.astype(np.float32)
        if value.ndim == 2 and kind != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(value, kind)
            writer.add_tensor(_gguf_name(hf_name), data, raw_shape=data.shape, raw_dtype=kind)
        else:
            writer.add_tensor(_gguf_name(hf_name), value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
