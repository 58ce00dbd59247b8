"""Writing a card image: header, metadata, tensor table, aligned tensor data, then the trailer
with the SHA-256 of everything before it and an optional Ed25519 signature.

Everything is written in one forward pass (the table is planned from the tensor specs before
any data), into a temporary file renamed into place at the end: an interrupted pack never leaves
a half-written image under the final name. A second thread hashes what is written (SHA-256
releases the GIL on large buffers), so hashing overlaps reading and writing.
"""

from __future__ import annotations

import errno
import hashlib
import os
import queue
import secrets
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from exstill_sdk.errors import ImageError
from exstill_sdk.image.format import (
    ALIGNMENT,
    FORMAT_VERSION,
    HEADER_SIZE,
    NUMPY_DTYPES,
    TRAILER_SIZE,
    align,
)
from exstill_sdk.image.metadata import encode_metadata
from exstill_sdk.image.schema import HEADER, TENSOR, TRAILER, TRAILER_SIGNED
from exstill_sdk.image.signing import sign_digest


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: int
    """A format.DType code."""
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=object)) * NUMPY_DTYPES[self.dtype].itemsize


WRITE_CHUNK = 8 << 20


class _Hasher:
    """SHA-256 of a byte stream, computed by a worker thread in submission order."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self._queue: queue.Queue[memoryview | bytes | None] = queue.Queue(maxsize=16)
        self._thread = threading.Thread(target=self._run, name="exstill-image-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (chunk := self._queue.get()) is not None:
            self._hash.update(chunk)

    def update(self, chunk: memoryview | bytes) -> None:
        self._queue.put(chunk)  # blocks when the hasher is 16 chunks behind: bounded memory

    def digest(self) -> bytes:
        self._queue.put(None)
        self._thread.join()
        return self._hash.digest()

    def digest_with(self, tail: bytes) -> bytes:
        """The digest of the stream followed by ``tail`` (after ``digest``)."""
        h = self._hash.copy()
        h.update(tail)
        return h.digest()


@dataclass(frozen=True)
class WrittenImage:
    path: Path
    size: int
    content_sha256: bytes
    """SHA-256 of everything before the trailer: what the trailer records and a signature covers."""
    file_sha256: bytes
    """SHA-256 of the whole file: what the card keys an upload by, and flash and list show."""
    key_id: bytes | None


def build_trailer(digest: bytes, key: Ed25519PrivateKey | None) -> tuple[bytes, bytes | None]:
    """The trailer bytes for a digest, signed when a key is given, and the key id."""
    kid, signature, flags = bytes(32), bytes(64), 0
    if key is not None:
        (kid, signature), flags = sign_digest(key, digest), TRAILER_SIGNED
    trailer = TRAILER.build(
        dict(
            trailer_version=1,
            flags=flags,
            reserved=0,
            digest=digest,
            key_id=kid,
            signature=signature,
        )
    )
    return trailer, kid if key is not None else None


def _temporary_beside(path: Path) -> Path:
    """A new file's name in ``path``'s directory, for writing then renaming over ``path``. The
    file gets the usual mode (0666 less the umask), as ``open`` would give ``path`` itself."""
    directory = path.parent
    if not directory.is_dir():
        raise FileNotFoundError(
            errno.ENOENT,
            "no such directory: create it first, or write the image elsewhere",
            str(directory),
        )
    return directory / f".{path.name}.{secrets.token_hex(4)}.partial"


class ImageWriter:
    """Write tensors in the order of ``specs`` with ``write``, then ``finish``."""

    def __init__(
        self, path: str | Path, metadata: Mapping[str, Any], specs: Sequence[TensorSpec]
    ) -> None:
        self.path = Path(path)
        self._specs = list(specs)
        names = [s.name for s in self._specs]
        if len(set(names)) != len(names):
            raise ValueError("tensor names must be unique")
        meta = encode_metadata(metadata)
        offsets, cursor = [], 0
        for spec in self._specs:
            offsets.append(cursor)
            cursor = align(cursor + spec.nbytes)
        table = b"".join(
            TENSOR.build(
                dict(
                    name=s.name,
                    dtype=s.dtype,
                    ndim=len(s.shape),
                    shape=list(s.shape),
                    offset=o,
                    size=s.nbytes,
                )
            )
            for s, o in zip(self._specs, offsets, strict=True)
        )
        meta_offset = HEADER_SIZE
        table_offset = align(meta_offset + len(meta), 8)
        data_offset = align(table_offset + len(table))
        # The data region ends right after the last tensor, not on an alignment boundary.
        data_size = offsets[-1] + self._specs[-1].nbytes if self._specs else 0
        header = HEADER.build(
            dict(
                format_version=FORMAT_VERSION,
                header_size=HEADER_SIZE,
                flags=0,
                meta_offset=meta_offset,
                meta_size=len(meta),
                table_offset=table_offset,
                table_size=len(table),
                tensor_count=len(self._specs),
                reserved0=0,
                data_offset=data_offset,
                data_size=data_size,
                reserved=bytes(HEADER_SIZE - 72),
            )
        )
        self._offsets = [data_offset + o for o in offsets]
        self.data_size = data_size
        self.total_size = data_offset + data_size
        self._pos = 0
        self._next = 0
        self._tmp = _temporary_beside(self.path)
        self._hash = _Hasher()
        try:  # from here on, anything (Ctrl-C included) removes the partial file
            self._file: BinaryIO = open(self._tmp, "xb")  # noqa: SIM115 - closed by finish/abort
            self._put(header)
            self._pad_to(table_offset, meta)
            self._pad_to(data_offset, table)
        except BaseException:
            self.abort()
            raise

    def _put(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        for start in range(0, len(view), WRITE_CHUNK):
            chunk = view[start : start + WRITE_CHUNK]
            self._file.write(chunk)
            self._hash.update(chunk)
        self._pos += len(view)

    def _pad_to(self, end: int, data: bytes) -> None:
        self._put(data)
        if end > self._pos:
            self._put(bytes(end - self._pos))

    @property
    def remaining(self) -> list[TensorSpec]:
        return self._specs[self._next :]

    def write(self, name: str, array: np.ndarray) -> None:
        """The next tensor's data; it must match its spec's name, dtype and shape."""
        spec = self._specs[self._next]
        if name != spec.name:
            raise ValueError(f"expected tensor {spec.name!r} next, got {name!r}")
        want = NUMPY_DTYPES[spec.dtype]
        if array.dtype != want or tuple(array.shape) != spec.shape:
            raise ValueError(
                f"tensor {name!r}: got {array.dtype} {array.shape}, spec says {want} {spec.shape}"
            )
        offset = self._offsets[self._next]
        if offset > self._pos:
            self._put(bytes(offset - self._pos))
        self._put(np.ascontiguousarray(array).data.cast("B"))
        self._next += 1

    def finish(self, signing_key: Ed25519PrivateKey | None = None) -> WrittenImage:
        try:
            if self._next != len(self._specs):
                raise ValueError(f"{len(self._specs) - self._next} tensors were not written")
            assert self._pos == self.total_size
            digest = self._hash.digest()
            trailer, kid = build_trailer(digest, signing_key)
            file_sha256 = self._hash.digest_with(trailer)
            self._file.write(trailer)
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise
        return WrittenImage(self.path, self.total_size + len(trailer), digest, file_sha256, kid)

    def abort(self) -> None:
        """Discard the partial file (again, harmlessly, when it is gone already)."""
        file = getattr(self, "_file", None)  # absent when opening it was interrupted
        if file is None or not file.closed:
            if file is not None:
                file.close()
            self._hash.digest()  # stop the hashing thread
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> ImageWriter:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if t is not None:
            self.abort()


def sign_image(
    path: str | Path, key: Ed25519PrivateKey, output: str | Path | None = None
) -> WrittenImage:
    """Sign a packed image (replacing any signature it had): its digest is checked first, then
    a copy with the new trailer is written beside ``output`` (default: the image itself) and
    renamed over it, so a crash leaves either the old file or the new one."""
    from exstill_sdk.image.reader import open_image

    source = Path(path)
    target = Path(output) if output is not None else source
    with open_image(source, verify=True) as image:
        content = image.content_sha256
        body = image.size - TRAILER_SIZE
    trailer, kid = build_trailer(content, key)
    tmp = _temporary_beside(target)
    try:
        with open(source, "rb") as src, open(tmp, "xb") as dst:
            h = hashlib.sha256()
            left = body
            while left:
                chunk = src.read(min(WRITE_CHUNK, left))
                if not chunk:
                    raise ImageError(f"{source} shrank while it was being signed")
                dst.write(chunk)
                h.update(chunk)
                left -= len(chunk)
            dst.write(trailer)
            h.update(trailer)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return WrittenImage(target, body + TRAILER_SIZE, content, h.digest(), kid)


__all__ = [
    "ALIGNMENT",
    "ImageWriter",
    "TensorSpec",
    "WrittenImage",
    "build_trailer",
    "sign_image",
]
