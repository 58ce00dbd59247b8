"""Constants of card image format v1 (docs/image-format.md): layout, dtypes and the caps that
bound everything a header can ask for."""

from __future__ import annotations

import numpy as np

MAGIC = b"EXSTILL\x1a"
FORMAT_VERSION = 1
HEADER_SIZE = 96
TRAILER_MAGIC = b"EXSTSIG\x1a"
TRAILER_SIZE = 144
ALIGNMENT = 4096
"""Every tensor starts at a multiple of this many bytes from the start of the file."""

SIGNATURE_DOMAIN = b"exstill-card-image-v1\x00"
"""Prefix of the message an Ed25519 signature covers: DOMAIN || SHA-256 digest."""

# Caps on anything a header can ask for: a reader allocates nothing bigger.
MAX_METADATA_BYTES = 1 << 20
MAX_METADATA_ENTRIES = 4096
MAX_KEY_BYTES = 256
MAX_STRING_BYTES = 1 << 16
MAX_ARRAY_ITEMS = 1 << 16
MAX_TENSORS = 1 << 16
MAX_TABLE_BYTES = 16 << 20
MAX_NAME_BYTES = 256
MAX_NDIM = 4
MAX_DIM = 1 << 32
MAX_FILE_BYTES = 1 << 40


class DType:
    """Tensor dtypes a card image may hold (a whitelist: any other code is refused)."""

    F32 = 0
    F16 = 1
    I8 = 2


NUMPY_DTYPES: dict[int, np.dtype] = {
    DType.F32: np.dtype("<f4"),
    DType.F16: np.dtype("<f2"),
    DType.I8: np.dtype("i1"),
}
DTYPE_NAMES = {DType.F32: "f32", DType.F16: "f16", DType.I8: "i8"}


class MetaType:
    """Value types of metadata entries."""

    U64 = 0
    I64 = 1
    F64 = 2
    BOOL = 3
    STR = 4
    BYTES = 5
    U64_ARRAY = 6


def align(n: int, to: int = ALIGNMENT) -> int:
    return -(-n // to) * to
