"""Reading a card image: map it, check every byte range, and hand out tensors as numpy views.

``open_image`` costs O(header + metadata + tensor table), never O(file): the data is mapped,
not read, and tensors are read-only views into the map. Every offset, size, count, alignment
and overlap is checked against the file and against the caps in ``format.py`` before anything
is used, and any malformed input raises ``ImageError`` (or ``ImageSignatureError``) with a
message that names the problem. The digest (O(file)) is checked by ``verify``, which a card
always runs before it accepts an image; ``open_image(..., verify=True)`` does both.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import mmap
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import construct as c
import numpy as np

from exstill_sdk.errors import ImageError, ImageNotFoundError
from exstill_sdk.image.arch import DecoderConfig
from exstill_sdk.image.format import (
    ALIGNMENT,
    DTYPE_NAMES,
    FORMAT_VERSION,
    HEADER_SIZE,
    MAX_DIM,
    MAX_FILE_BYTES,
    MAX_METADATA_BYTES,
    MAX_NAME_BYTES,
    MAX_NDIM,
    MAX_TABLE_BYTES,
    MAX_TENSORS,
    NUMPY_DTYPES,
    TRAILER_SIZE,
    DType,
)
from exstill_sdk.image.metadata import MetaValue, decode_metadata
from exstill_sdk.image.schema import HEADER, TENSOR, TRAILER, TRAILER_SIGNED
from exstill_sdk.image.signing import TrustedKeys, check_signature
from exstill_sdk.image.tokenizer import TokenizerFingerprint, fingerprint_from_metadata

HEAD_IDS = "head.ids"
RANK_TEMPERATURE = "draft.rank_temperature"
DEFAULT_RANK_TEMPERATURE = 0.5
"""The ranking temperature of an image without one: images packed before the field, and the
demo draft (whose calibrated temperature is 0.45, docs/benchmarks.md, token trees)."""
RANK_TEMPERATURES = (0.05, 20.0)
QUANT_DTYPES = {"f32": DType.F32, "f16": DType.F16, "int8": DType.I8}
HASH_CHUNK = 16 << 20


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: int
    shape: tuple[int, ...]
    offset: int
    """Absolute byte offset in the file."""
    size: int


@dataclass(frozen=True)
class Verification:
    content_sha256: bytes
    """SHA-256 of everything before the trailer (recomputed, and equal to the trailer's)."""
    file_sha256: bytes
    """SHA-256 of the whole file: what flash and the card's image list show."""
    signed: bool
    key_id: bytes | None
    trusted: bool
    """True when the signature was checked against a trusted key (and held)."""


def _fail(message: str) -> ImageError:
    return ImageError(message)


def _str_meta(meta: Mapping[str, MetaValue], key: str) -> str:
    value = meta.get(key)
    if not isinstance(value, str):
        raise _fail(f"metadata {key!r} is missing or not a string")
    return value


def _head_ids(meta: Mapping[str, MetaValue], arch: DecoderConfig) -> np.ndarray | None:
    ids = meta.get(HEAD_IDS)
    if not arch.head_size:
        if ids is not None:
            raise _fail(f"metadata {HEAD_IDS!r} is set but arch.head_size is 0")
        return None
    if not isinstance(ids, list) or len(ids) != arch.head_size:
        raise _fail(f"metadata {HEAD_IDS!r} must list arch.head_size ({arch.head_size}) ids")
    out = np.array(ids, np.int64)
    if out.max() >= arch.vocab_size or len(np.unique(out)) != len(out):
        raise _fail(f"metadata {HEAD_IDS!r} must hold distinct ids below the vocabulary size")
    out.flags.writeable = False
    return out


def _rank_temperature(meta: Mapping[str, MetaValue]) -> float:
    value = meta.get(RANK_TEMPERATURE, DEFAULT_RANK_TEMPERATURE)
    low, high = RANK_TEMPERATURES
    if not isinstance(value, float) or not low <= value <= high:
        raise _fail(f"metadata {RANK_TEMPERATURE!r} must be a float from {low} to {high}")
    return value


class CardImage:
    """A parsed, bounds-checked card image over a buffer (a read-only mmap or bytes)."""

    def __init__(self, buffer: Any, path: Path | None = None) -> None:
        self._buffer = buffer
        self.path = path
        self.size = len(buffer)
        self._parse()

    # ------------------------------------------------------------------ parsing

    def _parse(self) -> None:
        size, buf = self.size, self._buffer
        if size < HEADER_SIZE + TRAILER_SIZE:
            raise _fail(f"file of {size} bytes is too short to be a card image")
        if size > MAX_FILE_BYTES:
            raise _fail(f"file of {size} bytes is larger than a card image may be")
        try:
            h = HEADER.parse(bytes(buf[:HEADER_SIZE]))
        except c.ConstError:
            raise _fail("not a card image: bad magic bytes") from None
        except c.ConstructError as exc:
            raise _fail(f"header is malformed: {exc}") from None
        if h.format_version != FORMAT_VERSION:
            raise _fail(
                f"image format version {h.format_version} is not supported (this SDK reads "
                f"version {FORMAT_VERSION})"
            )
        if h.header_size != HEADER_SIZE or h.flags or h.reserved0 or any(h.reserved):
            raise _fail("header size, flags or reserved fields are not as version 1 defines")
        end_of_data = size - TRAILER_SIZE
        checks = [
            (h.meta_offset >= HEADER_SIZE, "metadata starts inside the header"),
            (h.meta_size <= MAX_METADATA_BYTES, f"metadata of {h.meta_size} bytes exceeds the cap"),
            (h.meta_offset + h.meta_size <= h.table_offset, "metadata overlaps the tensor table"),
            (
                h.table_size <= MAX_TABLE_BYTES,
                f"tensor table of {h.table_size} bytes exceeds the cap",
            ),
            (h.tensor_count <= MAX_TENSORS, f"{h.tensor_count} tensors exceed the cap"),
            (h.table_offset + h.table_size <= h.data_offset, "tensor table overlaps the data"),
            (h.data_offset % ALIGNMENT == 0, f"data offset {h.data_offset} is not aligned"),
            (
                h.data_offset + h.data_size == end_of_data,
                f"header says data ends at {h.data_offset + h.data_size}, the trailer starts at "
                f"{end_of_data} (truncated or padded file?)",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise _fail(message)
        self.data_offset, self.data_size = h.data_offset, h.data_size
        self.metadata = decode_metadata(bytes(buf[h.meta_offset : h.meta_offset + h.meta_size]))
        self.tensors = self._parse_table(
            bytes(buf[h.table_offset : h.table_offset + h.table_size]), h.tensor_count
        )
        self._parse_trailer(bytes(buf[end_of_data:]))
        self._check_contents()

    def _parse_table(self, table: bytes, count: int) -> dict[str, TensorInfo]:
        try:
            entries = c.Array(count, TENSOR).parse(table)
        except (c.ConstructError, UnicodeDecodeError) as exc:
            raise _fail(f"tensor table is malformed: {str(exc).splitlines()[0]}") from None
        out: dict[str, TensorInfo] = {}
        for e in entries:
            name = e.name
            if not name or len(name.encode()) > MAX_NAME_BYTES:
                raise _fail(f"tensor name {name[:40]!r} is empty or too long")
            if name in out:
                raise _fail(f"tensor {name!r} appears twice")
            if e.dtype not in NUMPY_DTYPES:
                raise _fail(f"tensor {name!r} has unknown dtype code {e.dtype}")
            if not 1 <= e.ndim <= MAX_NDIM or not all(1 <= d <= MAX_DIM for d in e.shape):
                raise _fail(f"tensor {name!r} has an unsupported shape {list(e.shape)}")
            nbytes = NUMPY_DTYPES[e.dtype].itemsize
            for d in e.shape:
                nbytes *= d
            if nbytes != e.size:
                raise _fail(f"tensor {name!r}: size {e.size} does not match its shape ({nbytes})")
            if e.offset % ALIGNMENT:
                raise _fail(f"tensor {name!r} at offset {e.offset} is not {ALIGNMENT}-aligned")
            if e.offset + e.size > self.data_size:
                raise _fail(f"tensor {name!r} runs past the end of the data region")
            out[name] = TensorInfo(
                name, e.dtype, tuple(e.shape), self.data_offset + e.offset, e.size
            )
        ordered = sorted(out.values(), key=lambda t: t.offset)
        for a, b in itertools.pairwise(ordered):
            if a.offset + a.size > b.offset:
                raise _fail(f"tensors {a.name!r} and {b.name!r} overlap")
        return out

    def _parse_trailer(self, raw: bytes) -> None:
        try:
            t = TRAILER.parse(raw)
        except c.ConstructError:
            raise _fail(
                "trailer is missing or corrupt (bad magic): the file is truncated?"
            ) from None
        if t.trailer_version != 1 or t.flags & ~TRAILER_SIGNED or t.reserved:
            raise _fail("trailer version, flags or reserved fields are not as version 1 defines")
        self.content_sha256 = t.digest
        """SHA-256 of everything before the trailer, as the trailer records it."""
        self.signed = bool(t.flags & TRAILER_SIGNED)
        self.key_id = t.key_id if self.signed else None
        self._signature = t.signature
        if not self.signed and (any(t.key_id) or any(t.signature)):
            raise _fail("unsigned trailer carries key id or signature bytes")

    def _check_contents(self) -> None:
        meta = self.metadata
        self.target = _str_meta(meta, "image.target")
        self.image_version = _str_meta(meta, "image.version")
        self.created_by = _str_meta(meta, "image.created_by")
        self.quant = _str_meta(meta, "quant.dtype")
        if self.quant not in QUANT_DTYPES:
            raise _fail(f"quant.dtype {self.quant!r} is not one of {', '.join(QUANT_DTYPES)}")
        self.arch = DecoderConfig.from_metadata(meta)
        self.head_ids = _head_ids(meta, self.arch)
        """Target ids of the output head's rows (a frequency-ranked head), or None when the
        head covers the whole vocabulary."""
        self.rank_temperature = _rank_temperature(meta)
        """The temperature that calibrates the draft's probabilities (``exstill distill`` fits
        it): the card ranks a tree's nodes and the outcomes it drafts ahead for by the draft's
        softmax at it."""
        self.tokenizer: TokenizerFingerprint = fingerprint_from_metadata(meta)
        expected: dict[str, tuple[int, tuple[int, ...]]] = {}
        for name, shape in self.arch.tensor_shapes().items():
            if len(shape) == 2:
                expected[name] = (QUANT_DTYPES[self.quant], shape)
                if self.quant == "int8":
                    expected[name + ".scale"] = (DType.F32, shape[:1])
            else:
                expected[name] = (DType.F32, shape)
        for name, (dtype, shape) in expected.items():
            info = self.tensors.get(name)
            if info is None:
                raise _fail(f"tensor {name!r}, required by the architecture, is missing")
            if (info.dtype, info.shape) != (dtype, shape):
                raise _fail(
                    f"tensor {name!r} is {DTYPE_NAMES[info.dtype]} {list(info.shape)}; the "
                    f"architecture needs {DTYPE_NAMES[dtype]} {list(shape)}"
                )
        extra = set(self.tensors) - set(expected)
        if extra:
            raise _fail(f"tensors not in the architecture: {', '.join(sorted(extra)[:5])}")

    # ------------------------------------------------------------------ use

    def tensor(self, name: str) -> np.ndarray:
        """A read-only view of one tensor's data (no copy)."""
        try:
            info = self.tensors[name]
        except KeyError:
            raise KeyError(f"the image has no tensor {name!r}") from None
        dtype = NUMPY_DTYPES[info.dtype]
        view = np.frombuffer(self._buffer, dtype, info.size // dtype.itemsize, info.offset)
        return view.reshape(info.shape)

    def compute_digests(self) -> tuple[bytes, bytes]:
        """SHA-256 of everything before the trailer, and of the whole file (one read)."""
        h = hashlib.sha256()
        view = memoryview(self._buffer)
        end = self.size - TRAILER_SIZE
        for start in range(0, end, HASH_CHUNK):
            h.update(view[start : min(end, start + HASH_CHUNK)])
        content = h.digest()
        h.update(view[end : self.size])
        view.release()
        return content, h.digest()

    def verify(self, trusted_keys: TrustedKeys | None = None) -> Verification:
        """Check the digest and, when trusted keys are given, require a signature by one."""
        digest, file_sha256 = self.compute_digests()
        if digest != self.content_sha256:
            raise _fail(
                "digest mismatch: the image's contents changed after it was written "
                f"(stored {self.content_sha256.hex()[:16]}..., computed {digest.hex()[:16]}...)"
            )
        if trusted_keys is not None:
            check_signature(trusted_keys, digest, self.signed, self.key_id or b"", self._signature)
        return Verification(digest, file_sha256, self.signed, self.key_id, trusted_keys is not None)

    def describe(self) -> dict[str, Any]:
        """A JSON-ready summary (what ``exstill-pack inspect`` prints)."""
        return {
            "path": str(self.path) if self.path else None,
            "size": self.size,
            "target": self.target,
            "image_version": self.image_version,
            "created_by": self.created_by,
            "dtype": self.quant,
            "arch": {k.removeprefix("arch."): v for k, v in self.arch.to_metadata().items()},
            "tokenizer": self.tokenizer.to_dict(),
            "rank_temperature": self.rank_temperature,
            "tensors": len(self.tensors),
            "parameters": sum(
                int(np.prod(t.shape)) for n, t in self.tensors.items() if not n.endswith(".scale")
            ),
            "data_bytes": self.data_size,
            "content_sha256": self.content_sha256.hex(),
            "signed": self.signed,
            "key_id": self.key_id.hex() if self.key_id else None,
        }

    def close(self) -> None:
        """Unmap the file. Tensor views still alive keep the mapping; it goes with them."""
        if isinstance(self._buffer, mmap.mmap):
            with contextlib.suppress(BufferError):  # views still alive keep the map
                self._buffer.close()

    def __enter__(self) -> CardImage:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def open_image(
    path: str | Path, *, verify: bool = False, trusted_keys: TrustedKeys | None = None
) -> CardImage:
    """Map and check a card image. ``verify=True`` (implied by ``trusted_keys``) also checks the
    digest and the signature, which reads the whole file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise _fail(f"{path} is empty")
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except FileNotFoundError:
        raise ImageNotFoundError(f"cannot open {path}: no such file") from None
    except OSError as exc:
        raise ImageError(f"cannot open {path}: {exc.strerror or exc}") from None
    try:
        image = CardImage(buffer, path)
        if verify or trusted_keys is not None:
            image.verify(trusted_keys)
    except BaseException:
        buffer.close()
        raise
    return image


def parse_image(data: bytes) -> CardImage:
    """A card image from bytes in memory (the same checks as ``open_image``)."""
    return CardImage(data)
