"""Card images: one file per target with draft weights, architecture and tokenizer identity.

docs/image-format.md is the normative specification.

format.py     constants, dtypes and caps          schema.py    the construct schema
metadata.py   typed key/value metadata            arch.py      the reference architecture
tokenizer.py  tokenizer fingerprints              signing.py   Ed25519 keys and signatures
writer.py     ImageWriter                         reader.py    open_image / CardImage
checkpoint.py HF checkpoints as the reference architecture
quantize.py   int8 per-row quantisation           pack.py      checkpoint -> image
"""

from exstill_sdk.image.arch import ARCH_NAME, DecoderConfig, RopeScaling
from exstill_sdk.image.reader import CardImage, TensorInfo, Verification, open_image, parse_image
from exstill_sdk.image.signing import generate_keypair, load_private_key, load_trusted_keys
from exstill_sdk.image.tokenizer import (
    TokenizerFingerprint,
    fingerprint_hf_tokenizer,
    fingerprint_tokenizer_json,
    fingerprint_tokens,
)
from exstill_sdk.image.writer import ImageWriter, TensorSpec

__all__ = [
    "ARCH_NAME",
    "CardImage",
    "DecoderConfig",
    "ImageWriter",
    "RopeScaling",
    "TensorInfo",
    "TensorSpec",
    "TokenizerFingerprint",
    "Verification",
    "fingerprint_hf_tokenizer",
    "fingerprint_tokenizer_json",
    "fingerprint_tokens",
    "generate_keypair",
    "load_private_key",
    "load_trusted_keys",
    "open_image",
    "parse_image",
]
