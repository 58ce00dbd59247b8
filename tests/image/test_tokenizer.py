"""Tokenizer fingerprints agree between tokenizer.json (packing) and a loaded tokenizer
(serving), follow the documented canonical form, and tell different vocabularies apart."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from exstill_sdk.image import (
    fingerprint_hf_tokenizer,
    fingerprint_tokenizer_json,
    fingerprint_tokens,
)
from exstill_sdk.image.tokenizer import special_ids_from_checkpoint, tokenizer_json_vocab

from .checkpoints import VOCAB, save_tokenizer


def test_documented_canonical_form() -> None:
    fp = fingerprint_tokens(["<s>", None, "héllo"], {"eos": [0]})
    text = '{"format":"exstill-tokenizer-v1","tokens":["<s>",null,"héllo"]}'
    assert fp.sha256 == hashlib.sha256(text.encode("utf-8")).digest()
    assert fp.vocab_size == 3 and fp.special_ids == {"eos": (0,)}


def test_pack_side_equals_serving_side(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    save_tokenizer(tmp_path)
    tokens = tokenizer_json_vocab(json.loads((tmp_path / "tokenizer.json").read_text()))
    packed = fingerprint_tokenizer_json(
        tmp_path / "tokenizer.json", special_ids_from_checkpoint(tmp_path, tokens)
    )
    served = fingerprint_hf_tokenizer(AutoTokenizer.from_pretrained(tmp_path))
    assert packed.matches(served) and packed.mismatch(served) is None
    assert packed.vocab_size == VOCAB
    assert served.special_ids["bos"] == (0,) and served.special_ids["eos"] == (1,)


def test_different_vocabularies_differ(tmp_path: Path) -> None:
    save_tokenizer(tmp_path / "a")
    save_tokenizer(tmp_path / "b", vocab_size=VOCAB + 1)
    a = fingerprint_tokenizer_json(tmp_path / "a" / "tokenizer.json")
    b = fingerprint_tokenizer_json(tmp_path / "b" / "tokenizer.json")
    assert not a.matches(b) and "vocab size" in (a.mismatch(b) or "")
    swapped = json.loads((tmp_path / "a" / "tokenizer.json").read_text())
    vocab = swapped["model"]["vocab"]
    vocab["w0"], vocab["w1"] = vocab["w1"], vocab["w0"]
    c = fingerprint_tokenizer_json(swapped)
    assert c.vocab_size == a.vocab_size and not a.matches(c) and "hash" in (a.mismatch(c) or "")


def test_unigram_and_added_tokens() -> None:
    doc = {
        "model": {"type": "Unigram", "vocab": [["<unk>", 0.0], ["a", -1.0], ["b", -2.0]]},
        "added_tokens": [{"id": 5, "content": "<extra>", "special": True}],
    }
    assert tokenizer_json_vocab(doc) == ["<unk>", "a", "b", None, None, "<extra>"]
