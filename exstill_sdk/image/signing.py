"""Ed25519 signing of card images (keys in PEM files; ``exstill-pack keygen`` makes a pair).

An image's trailer holds the SHA-256 digest of everything before it; a signature covers
``SIGNATURE_DOMAIN || digest`` and names its key by ``key_id``, the SHA-256 of the raw 32-byte
public key. A verifier holds trusted public keys, looks the key id up among them and checks the
signature: an unsigned image, an unknown key or a bad signature is refused.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from exstill_sdk.errors import ImageSignatureError, InvalidArgumentError
from exstill_sdk.image.format import SIGNATURE_DOMAIN

TrustedKeys = Mapping[bytes, Ed25519PublicKey]


def key_id(public_key: Ed25519PublicKey) -> bytes:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).digest()


def generate_keypair(directory: str | Path, name: str = "exstill") -> tuple[Path, Path]:
    """Write NAME.key (PKCS#8 PEM, mode 0600) and NAME.pub (SubjectPublicKeyInfo PEM)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    private = Ed25519PrivateKey.generate()
    key_path, pub_path = directory / f"{name}.key", directory / f"{name}.pub"
    if key_path.exists():
        raise FileExistsError(f"{key_path} exists; choose another name or remove it first")
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(
            private.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    pub_path.write_bytes(
        private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return key_path, pub_path


def _key_file(path: str | Path, kind: str) -> bytes:
    """A key file's bytes; a file that cannot be read is a mistake in the command line."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgumentError(
            f"cannot read the {kind} {path}: {exc.strerror} (make a key pair: exstill-pack keygen)"
        ) from None


def load_private_key(path: str | Path) -> Ed25519PrivateKey:
    data = _key_file(path, "signing key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise ImageSignatureError(
            f"{path} is not a PEM signing key (make one: exstill-pack keygen): {exc}"
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ImageSignatureError(
            f"{path} is not an Ed25519 private key (make one: exstill-pack keygen)"
        )
    return key


def load_public_key(path: str | Path) -> Ed25519PublicKey:
    data = _key_file(path, "public key")
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise ImageSignatureError(f"{path} is not a PEM public key: {exc}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise ImageSignatureError(f"{path} is not an Ed25519 public key")
    return key


def load_trusted_keys(source: str | Path) -> dict[bytes, Ed25519PublicKey]:
    """Trusted public keys from a directory of ``*.pub`` files, or from one ``.pub`` file."""
    source = Path(source)
    paths = sorted(source.glob("*.pub")) if source.is_dir() else [source]
    if not paths:
        raise ImageSignatureError(f"no *.pub files in {source}")
    keys = [load_public_key(p) for p in paths]
    return {key_id(k): k for k in keys}


def sign_digest(private_key: Ed25519PrivateKey, digest: bytes) -> tuple[bytes, bytes]:
    """(key id, signature) for an image digest."""
    return key_id(private_key.public_key()), private_key.sign(SIGNATURE_DOMAIN + digest)


def check_signature(
    trusted: TrustedKeys, digest: bytes, signed: bool, kid: bytes, signature: bytes
) -> None:
    """Raise ImageSignatureError unless a trusted key made this signature over this digest."""
    if not signed:
        raise ImageSignatureError("the image is not signed, and trusted keys are required")
    public = trusted.get(kid)
    if public is None:
        raise ImageSignatureError(
            f"the image is signed by key {kid.hex()[:16]}..., which is not among the "
            f"{len(trusted)} trusted key(s)"
        )
    try:
        public.verify(signature, SIGNATURE_DOMAIN + digest)
    except InvalidSignature:
        raise ImageSignatureError(
            f"the signature by key {kid.hex()[:16]}... does not verify: the image or its "
            "trailer was altered"
        ) from None
