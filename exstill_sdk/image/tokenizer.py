"""Tokenizer fingerprints: the identity of a target's tokenizer, carried in every card image.

A draft model is only useful to a target that splits text into the same token ids. The
fingerprint is computed the same way on both sides (from the checkpoint's tokenizer.json when
packing; from the serving code's tokenizer when opening a stream) and compared before any token
is drafted:

- ``vocab_size``: one more than the largest token id the tokenizer defines;
- ``sha256``: SHA-256 of the canonical form, the UTF-8 bytes of the compact JSON text
  ``{"format":"exstill-tokenizer-v1","tokens":[T0,T1,...]}`` where ``Ti`` is the string of token
  id i (its vocabulary entry, added tokens included) or ``null`` for an unused id; keys in that
  order, no spaces, non-ASCII characters written as themselves;
- ``special_ids``: the ids of ``bos``, ``eos`` (possibly several), ``pad`` and ``unk`` where the
  tokenizer defines them. They are not part of the hash, which is about how text becomes ids;
  they tell the decoder when to stop.

Two fingerprints match when their vocab sizes and hashes are equal.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exstill_sdk.errors import ImageError

FORMAT = "exstill-tokenizer-v1"
SPECIAL_NAMES = ("bos", "eos", "pad", "unk")
MAX_VOCAB = 1 << 24


@dataclass(frozen=True)
class TokenizerFingerprint:
    vocab_size: int
    sha256: bytes
    special_ids: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    def matches(self, other: TokenizerFingerprint) -> bool:
        return self.vocab_size == other.vocab_size and self.sha256 == other.sha256

    def mismatch(self, other: TokenizerFingerprint) -> str | None:
        """None when they match; otherwise what differs, for an error message."""
        if self.vocab_size != other.vocab_size:
            return f"vocab size {self.vocab_size} != {other.vocab_size}"
        if self.sha256 != other.sha256:
            return f"tokenizer hash {self.sha256.hex()[:16]}... != {other.sha256.hex()[:16]}..."
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "vocab_size": self.vocab_size,
            "sha256": self.sha256.hex(),
            "special_ids": {k: list(v) for k, v in self.special_ids.items()},
        }


def fingerprint_tokens(
    tokens: Sequence[str | None], special_ids: Mapping[str, Sequence[int]] | None = None
) -> TokenizerFingerprint:
    """The fingerprint of a token list (index = id; None for an unused id)."""
    if len(tokens) > MAX_VOCAB:
        raise ValueError(f"a vocabulary of {len(tokens)} tokens is beyond {MAX_VOCAB}")
    canonical = json.dumps(
        {"format": FORMAT, "tokens": list(tokens)}, ensure_ascii=False, separators=(",", ":")
    )
    specials = {
        name: tuple(int(i) for i in ids)
        for name, ids in (special_ids or {}).items()
        if name in SPECIAL_NAMES and ids
    }
    return TokenizerFingerprint(
        len(tokens), hashlib.sha256(canonical.encode("utf-8")).digest(), specials
    )


def vocab_list(vocab: Mapping[str, int]) -> list[str | None]:
    """A token -> id mapping as a list indexed by id."""
    if not vocab:
        return []
    size = max(vocab.values()) + 1
    if size > MAX_VOCAB or min(vocab.values()) < 0:
        raise ValueError("token ids must be in 0..2**24")
    tokens: list[str | None] = [None] * size
    for token, i in vocab.items():
        tokens[i] = token
    return tokens


def tokenizer_json_vocab(data: Mapping[str, Any]) -> list[str | None]:
    """The id-indexed token list of an HF ``tokenizer.json`` document, added tokens included."""
    model = data.get("model") or {}
    raw = model.get("vocab")
    vocab: dict[str, int] = {}
    if isinstance(raw, Mapping):  # BPE, WordPiece, WordLevel
        vocab = {str(k): int(v) for k, v in raw.items()}
    elif isinstance(raw, list):  # Unigram: [[piece, score], ...], id = position
        vocab = {str(entry[0]): i for i, entry in enumerate(raw)}
    elif raw is not None:
        raise ValueError("tokenizer.json: model.vocab is neither a mapping nor a list")
    tokens = vocab_list(vocab)
    for added in data.get("added_tokens") or []:
        i = int(added["id"])
        if not 0 <= i < MAX_VOCAB:
            raise ValueError(f"tokenizer.json: added token id {i} out of range")
        if i >= len(tokens):
            tokens += [None] * (i + 1 - len(tokens))
        tokens[i] = str(added["content"])
    return tokens


def fingerprint_tokenizer_json(
    source: str | Path | Mapping[str, Any], special_ids: Mapping[str, Sequence[int]] | None = None
) -> TokenizerFingerprint:
    """The fingerprint of an HF ``tokenizer.json`` (a path or the parsed document)."""
    data = json.loads(Path(source).read_text("utf-8")) if isinstance(source, str | Path) else source
    return fingerprint_tokens(tokenizer_json_vocab(data), special_ids)


def fingerprint_hf_tokenizer(tokenizer: Any) -> TokenizerFingerprint:
    """The fingerprint of a loaded HF *fast* tokenizer, as serving code has it: the same value
    ``exstill-pack`` computes from the checkpoint's tokenizer.json."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError("need a fast (tokenizers-backed) HF tokenizer, e.g. use_fast=True")
    specials: dict[str, list[int]] = {}
    for name in SPECIAL_NAMES:
        value = getattr(tokenizer, f"{name}_token_id", None)
        if value is not None:
            specials[name] = list(value) if isinstance(value, list | tuple) else [int(value)]
    return fingerprint_tokenizer_json(json.loads(backend.to_str()), specials)


def special_ids_from_checkpoint(
    directory: Path, tokens: Sequence[str | None]
) -> dict[str, list[int]]:
    """Special token ids of a checkpoint: generation_config.json, then config.json, then the
    token strings named in tokenizer_config.json."""
    found: dict[str, list[int]] = {}
    index = {t: i for i, t in enumerate(tokens) if t is not None}
    for name in ("generation_config.json", "config.json"):
        path = directory / name
        if not path.exists():
            continue
        config = json.loads(path.read_text("utf-8"))
        for key in SPECIAL_NAMES:
            value = config.get(f"{key}_token_id")
            if key in found or value is None:
                continue
            found[key] = [int(v) for v in value] if isinstance(value, list) else [int(value)]
    path = directory / "tokenizer_config.json"
    if path.exists():
        config = json.loads(path.read_text("utf-8"))
        for key in SPECIAL_NAMES:
            value = config.get(f"{key}_token")
            if isinstance(value, Mapping):
                value = value.get("content")
            if key not in found and isinstance(value, str) and value in index:
                found[key] = [index[value]]
    return found


def fingerprint_from_metadata(meta: Mapping[str, Any]) -> TokenizerFingerprint:
    """The fingerprint stored in an image's metadata (keys ``tokenizer.*``)."""
    try:
        size = meta["tokenizer.vocab_size"]
        digest = meta["tokenizer.sha256"]
    except KeyError as exc:
        raise ImageError(
            f"metadata lacks {exc.args[0]!r}: the image has no tokenizer identity"
        ) from None
    if not isinstance(size, int) or not isinstance(digest, bytes) or len(digest) != 32:
        raise ImageError("metadata tokenizer.vocab_size / tokenizer.sha256 have the wrong type")
    specials = {}
    for name in SPECIAL_NAMES:
        value = meta.get(f"tokenizer.{name}_ids")
        if value is not None:
            if not isinstance(value, list):
                raise ImageError(f"metadata tokenizer.{name}_ids must be a list of ids")
            specials[name] = tuple(value)
    return TokenizerFingerprint(size, digest, specials)


def fingerprint_to_metadata(fp: TokenizerFingerprint) -> dict[str, Any]:
    out: dict[str, Any] = {"tokenizer.vocab_size": fp.vocab_size, "tokenizer.sha256": fp.sha256}
    for name, ids in fp.special_ids.items():
        out[f"tokenizer.{name}_ids"] = list(ids)
    return out
