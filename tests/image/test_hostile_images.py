"""Malformed and hostile images are refused with ImageError and a precise message, and nothing
else ever escapes the reader."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exstill_sdk import ImageError
from exstill_sdk.image import parse_image
from exstill_sdk.image.format import TRAILER_SIZE, MetaType

from .hostile import reseal, with_header, with_metadata, with_table


def _refused(data: bytes, match: str) -> None:
    with pytest.raises(ImageError, match=match):
        image = parse_image(data)
        image.verify()


def test_the_valid_image_opens(small_image: bytes) -> None:
    image = parse_image(small_image)
    assert image.verify().content_sha256 == image.content_sha256
    assert reseal(small_image) == small_image


def set_field(index: int, **values):
    def edit(table: list) -> None:
        for k, v in values.items():
            table[index][k] = v

    return edit


def test_lying_tables(small_image: bytes) -> None:
    image = small_image
    _refused(with_table(image, set_field(1, offset=4096 + 8)), "not 4096-aligned")
    _refused(with_table(image, set_field(1, offset=1 << 40)), "runs past the end")
    _refused(with_table(image, set_field(2, offset=0)), "overlap")
    _refused(with_table(image, set_field(1, size=12)), "does not match its shape")
    _refused(with_table(image, set_field(0, shape=[1 << 40, 1 << 40])), "unsupported shape")
    _refused(with_table(image, set_field(0, shape=[0, 64])), "unsupported shape")
    _refused(with_table(image, set_field(0, dtype=7)), "unknown dtype code 7")

    def dup(table: list) -> None:
        names = [t.name for t in table]
        table[names.index("layers.0.attn.k.weight")].name = "layers.0.attn.q.weight"

    _refused(with_table(image, dup), "appears twice")

    def rename(table: list) -> None:
        table[-1].name = "z" * len(table[-1].name)

    _refused(with_table(image, rename), "missing")


def test_lying_headers(small_image: bytes) -> None:
    image = small_image
    _refused(with_header(image, tensor_count=1 << 31), "exceed the cap")
    _refused(with_header(image, meta_size=1 << 40), "exceeds the cap")
    _refused(with_header(image, table_size=1 << 40), "exceeds the cap")
    _refused(with_header(image, data_offset=4096 + 8), "not aligned")
    _refused(with_header(image, data_size=1), "truncated or padded")
    _refused(with_header(image, meta_offset=8), "inside the header")
    _refused(with_header(image, format_version=2), "format version 2 is not supported")
    _refused(with_header(image, flags=1), "reserved")
    _refused(b"GARBAGE!" + image[8:], "bad magic")
    _refused(image[: len(image) // 2], "truncated or padded|bad magic|trailer")
    _refused(image[:100], "too short")
    _refused(image + b"\x00" * 4096, "truncated or padded")


def test_lying_metadata(small_image: bytes) -> None:
    image = small_image

    def drop(key: str):
        return lambda meta: meta.pop(key)

    _refused(with_metadata(image, drop("arch.hidden_size")), "arch.hidden_size")
    _refused(with_metadata(image, drop("tokenizer.sha256")), "tokenizer")
    _refused(with_metadata(image, drop("image.target")), "image.target")

    def retype(meta: dict) -> None:
        meta["arch.num_layers"] = (MetaType.STR, "two")

    _refused(with_metadata(image, retype), "arch.num_layers")

    def wrong_arch(meta: dict) -> None:
        meta["arch.num_layers"] = (MetaType.U64, 3)

    _refused(with_metadata(image, wrong_arch), "required by the architecture, is missing")

    def foreign(meta: dict) -> None:
        meta["arch.name"] = (MetaType.STR, "mamba")

    _refused(with_metadata(image, foreign), "not supported by this SDK")

    # an entry count meant to exhaust memory: patch the first u32 of the metadata
    from exstill_sdk.image.schema import HEADER

    h = HEADER.parse(image[:96])
    bad = image[: h.meta_offset] + (0xFFFFFFFF).to_bytes(4, "little") + image[h.meta_offset + 4 :]
    _refused(reseal(bad), "claims 4294967295 entries")
    # a string length meant to exhaust memory: the first key's u16 length, then a u32 length
    bad = image[: h.meta_offset + 4] + b"\xff\xff" + image[h.meta_offset + 6 :]
    _refused(reseal(bad), "metadata is malformed")


def test_digest_and_trailer(small_image: bytes) -> None:
    image = bytearray(small_image)
    image[len(image) // 2] ^= 0x01
    _refused(bytes(image), "digest mismatch")
    image = bytearray(small_image)
    image[-TRAILER_SIZE] ^= 0xFF
    _refused(bytes(image), "trailer is missing or corrupt")
    image = bytearray(small_image)
    image[-64] = 1  # signature bytes in an unsigned trailer
    _refused(bytes(image), "unsigned trailer")


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutations_raise_only_image_error(small_image: bytes, data) -> None:
    """Bit flips, truncations, splices and field overwrites: ImageError or a valid image."""
    image = bytearray(small_image)
    kind = data.draw(st.sampled_from(["flip", "truncate", "splice", "overwrite", "header"]))
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(image) - 1))
            image[i] ^= 1 << data.draw(st.integers(0, 7))
    elif kind == "truncate":
        image = image[: data.draw(st.integers(0, len(image) - 1))]
    elif kind == "splice":
        a = data.draw(st.integers(0, len(image)))
        b = data.draw(st.integers(0, len(image)))
        image = image[:a] + data.draw(st.binary(max_size=64)) + image[b:]
    elif kind == "overwrite":
        i = data.draw(st.integers(0, min(len(image) - 8, 20000)))
        image[i : i + 8] = data.draw(st.binary(min_size=8, max_size=8))
    else:  # any u64 header field, then re-sealed so that the digest does not catch it
        i = data.draw(st.sampled_from(range(8, 96, 4)))
        image[i : i + 4] = data.draw(st.binary(min_size=4, max_size=4))
        image = bytearray(reseal(bytes(image)))
    try:
        parsed = parse_image(bytes(image))
        parsed.verify()
    except ImageError:
        return
