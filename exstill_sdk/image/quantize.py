"""int8 weights: symmetric, one scale per output channel (per row of a stored matrix).

For a row w, ``scale = max|w| / 127`` (1 for an all-zero row) and ``q = round(w / scale)``,
clipped to [-127, 127]; ``q * scale`` reproduces every element within ``scale / 2`` (plus the
float32 rounding of the division, a few ulp). -128 is never used, so negation is exact.
"""

from __future__ import annotations

import numpy as np

CHUNK_ROWS_BYTES = 64 << 20


def quantize_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int8 matrix, float32 scale per row) of a 2-D float matrix, processed in row chunks so
    that a large embedding never needs a second full-size float copy."""
    if w.ndim != 2:
        raise ValueError("int8 quantisation applies to matrices")
    rows, cols = w.shape
    q = np.empty((rows, cols), dtype=np.int8)
    scale = np.empty(rows, dtype=np.float32)
    step = max(1, CHUNK_ROWS_BYTES // max(1, cols * 4))
    for start in range(0, rows, step):
        block = np.asarray(w[start : start + step], dtype=np.float32)
        amax = np.abs(block).max(axis=1)
        s = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
        q[start : start + step] = np.clip(np.rint(block / s[:, None]), -127, 127)
        scale[start : start + step] = s
    return q, scale


def dequantize_rows(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * scale[:, None]
