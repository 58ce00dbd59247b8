"""Ed25519 signatures: verify with the signer's public key, fail with any other, and fail after
any byte of the image changes."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from exstill_sdk import ImageError, ImageSignatureError
from exstill_sdk.image import generate_keypair, load_private_key, load_trusted_keys, open_image
from exstill_sdk.image.format import TRAILER_SIZE
from exstill_sdk.image.pack import pack_checkpoint


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("keys")
    generate_keypair(directory, "alice")
    generate_keypair(directory, "bob")
    return directory


@pytest.fixture(scope="module")
def signed_image(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path, keys: Path) -> Path:
    path = tmp_path_factory.mktemp("signed") / "signed.img"
    pack_checkpoint(
        llama_dir, path, "tiny", "int8", signing_key=load_private_key(keys / "alice.key")
    )
    return path


def test_verifies_with_the_signers_key_only(signed_image: Path, keys: Path) -> None:
    alice = load_trusted_keys(keys / "alice.pub")
    bob = load_trusted_keys(keys / "bob.pub")
    with open_image(signed_image) as image:
        assert image.signed and image.key_id == next(iter(alice))
        result = image.verify(alice)
        assert result.trusted and result.signed
        with pytest.raises(ImageSignatureError, match="not among the 1 trusted"):
            image.verify(bob)
        assert image.verify(load_trusted_keys(keys)).trusted  # a directory with both


def test_a_forged_key_id_does_not_help(signed_image: Path, keys: Path, tmp_path: Path) -> None:
    """Claiming Bob's key id over Alice's signature fails the signature check itself."""
    bob = load_trusted_keys(keys / "bob.pub")
    data = bytearray(signed_image.read_bytes())
    start = len(data) - TRAILER_SIZE + 48
    data[start : start + 32] = next(iter(bob))
    forged = tmp_path / "forged.img"
    forged.write_bytes(bytes(data))
    with open_image(forged) as image, pytest.raises(ImageSignatureError, match="does not verify"):
        image.verify(bob)


def test_unsigned_image_is_refused_when_keys_are_required(
    llama_dir: Path, keys: Path, tmp_path: Path
) -> None:
    pack_checkpoint(llama_dir, tmp_path / "u.img", "tiny")
    with open_image(tmp_path / "u.img") as image:
        assert image.verify().signed is False
        with pytest.raises(ImageSignatureError, match="not signed"):
            image.verify(load_trusted_keys(keys))


def test_any_changed_byte_fails(signed_image: Path, keys: Path, tmp_path: Path) -> None:
    trusted = load_trusted_keys(keys / "alice.pub")
    original = signed_image.read_bytes()
    rng = random.Random(7)
    # every trailer byte, every header byte, and 200 bytes anywhere else
    positions = set(range(len(original) - TRAILER_SIZE, len(original))) | set(range(96))
    positions |= {rng.randrange(len(original)) for _ in range(200)}
    target = tmp_path / "changed.img"
    for pos in sorted(positions):
        data = bytearray(original)
        data[pos] ^= 1 << rng.randrange(8)
        target.write_bytes(bytes(data))
        with pytest.raises(ImageError), open_image(target) as image:
            image.verify(trusted)
