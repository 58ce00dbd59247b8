"""Tiny HF checkpoints built in the tests from configs (transformers), saved with
save_pretrained: nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import pytest

VOCAB = 96


def save_tokenizer(directory: Path, vocab_size: int = VOCAB) -> None:
    pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2, **{f"w{i}": i + 3 for i in range(vocab_size - 3)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(directory)


def save_model(
    directory: Path,
    family: str,
    tie: bool = False,
    dtype: str = "float32",
    scale: float = 0.02,
    seed: int = 0,
    base: Path | None = None,
) -> Path:
    """A tiny model; ``scale`` is the std of the noise added to every weight (larger values
    make logits far from flat, which exactness tests want)."""
    pytest.importorskip("torch", reason="needs the hf extra: pip install -e '.[hf]'")
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        bos_token_id=0,
        eos_token_id=1,
    )
    config_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    }[family]
    extra = {"head_dim": 16} if family == "qwen3" else {}
    model = model_cls(config_cls(**common, **extra)).to(getattr(torch, dtype))
    if base is not None:  # start from another checkpoint's weights (a perturbed copy)
        model.load_state_dict(model_cls.from_pretrained(base).state_dict())
    with torch.no_grad():  # make every tensor distinctive (norms are all ones at init)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    save_tokenizer(directory)
    return directory
