"""Running an image's decoder graph in onnxruntime over rows of preallocated KV buffers.

The card's transformer engine (firmware) and the ONNX target adapter (host side) share this:
an ``OnnxDecoder`` owns the session and, per layer, KV buffers [rows, kv_heads, positions,
head_dim]. A row is one sequence's cache; rows lo..hi-1 are bound (past and present on the same
memory) once per row range, so running a step copies no cache.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx
import onnxruntime as ort

from exstill_sdk.errors import ImageError
from exstill_sdk.execution.graph import build_decoder
from exstill_sdk.image.reader import CardImage

MAX_CHUNK = 256
"""Longest run of tokens one prefill call feeds."""


def open_session(
    image: CardImage, model: onnx.ModelProto, threads: int = 0
) -> ort.InferenceSession:
    """An onnxruntime CPU session for one of an image's graphs (weights read from the image)."""
    options = ort.SessionOptions()
    if image.path is not None:
        options.add_session_config_entry(
            "session.model_external_initializers_file_folder_path", str(image.path.parent)
        )
    if threads:
        options.intra_op_num_threads = threads
    try:
        return ort.InferenceSession(
            model.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
    except Exception as exc:  # onnxruntime raises its own types
        raise ImageError(
            f"onnxruntime {ort.__version__} cannot run the graph of image "
            f"{image.target!r}: {str(exc).splitlines()[0]}"
        ) from None


class _DecodeBuffers(NamedTuple):
    io: ort.IOBinding
    ids: np.ndarray
    seqlens: np.ndarray
    total: np.ndarray
    rows: np.ndarray
    logits: np.ndarray


class OnnxDecoder:
    def __init__(self, image: CardImage, rows: int, positions: int, threads: int = 0) -> None:
        arch = image.arch
        if arch.head_dim % 16:
            raise ImageError(
                f"head_dim {arch.head_dim} is not supported: onnxruntime's attention needs a "
                "multiple of 16"
            )
        self.arch = arch
        self.vocab_size = arch.vocab_size
        self.positions = positions
        self.session = open_session(image, build_decoder(image, positions), threads)
        shape = (rows, arch.num_kv_heads, positions, arch.head_dim)
        self.keys = [np.zeros(shape, np.float32) for _ in range(arch.num_layers)]
        self.values = [np.zeros(shape, np.float32) for _ in range(arch.num_layers)]
        self._bindings: dict[tuple[int, int, str], tuple[ort.IOBinding, list[np.ndarray]]] = {}
        self._decode: dict[tuple[int, int], _DecodeBuffers] = {}

    def kv_binding(
        self,
        lo: int,
        hi: int,
        purpose: str = "chunk",
        session: ort.InferenceSession | None = None,
    ) -> ort.IOBinding:
        """An IO binding of ``session`` (default: the decoder graph's) with rows lo..hi-1 of
        every KV buffer bound as past and present; one per purpose, made once."""
        entry = self._bindings.get((lo, hi, purpose))
        if entry is None:
            io = (session or self.session).io_binding()
            views = []
            for i in range(self.arch.num_layers):
                for past, present, buffer in (
                    (f"past_key_{i}", f"present_key_{i}", self.keys[i]),
                    (f"past_value_{i}", f"present_value_{i}", self.values[i]),
                ):
                    view = buffer[lo:hi]
                    views.append(view)
                    io.bind_input(past, "cpu", 0, np.float32, view.shape, view.ctypes.data)
                    io.bind_output(present, "cpu", 0, np.float32, view.shape, view.ctypes.data)
            entry = self._bindings[(lo, hi, purpose)] = (io, views)
        return entry[0]

    def _decode_binding(self, lo: int, hi: int) -> _DecodeBuffers:
        """Inputs and outputs of a one-token step over rows lo..hi-1, bound once: a step
        writes the tokens and positions into these arrays and runs, with no binding call."""
        buffers = self._decode.get((lo, hi))
        if buffers is None:
            io = self.kv_binding(lo, hi, "decode")  # its own binding: inputs stay bound
            b = hi - lo
            buffers = _DecodeBuffers(
                io,
                np.zeros((b, 1), np.int64),
                np.zeros(b, np.int32),
                np.zeros((), np.int32),
                np.arange(b, dtype=np.int64),
                np.empty((b, self.vocab_size), np.float32),
            )
            for name, array in (
                ("input_ids", buffers.ids),
                ("seqlens_k", buffers.seqlens),
                ("total_sequence_length", buffers.total),
                ("logit_rows", buffers.rows),
            ):
                io.bind_input(name, "cpu", 0, array.dtype, array.shape, array.ctypes.data)
            io.bind_output(
                "logits", "cpu", 0, np.float32, buffers.logits.shape, buffers.logits.ctypes.data
            )
            self._decode[(lo, hi)] = buffers
        return buffers

    def step(self, lo: int, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """One token for each of rows lo..lo+B-1 at cache ``positions``; logits [B, vocab]
        (a buffer reused by the next step of the same rows)."""
        d = self._decode_binding(lo, lo + len(tokens))
        d.ids[:, 0] = tokens
        d.seqlens[:] = positions
        d.total[...] = d.seqlens.max() + 1
        self.session.run_with_iobinding(d.io)
        return d.logits

    def forward(
        self, lo: int, ids: np.ndarray, positions: np.ndarray, logit_rows: np.ndarray
    ) -> np.ndarray:
        """Feed ``ids`` [B, S] to rows lo..lo+B-1, the first token of row b at cache position
        ``positions[b]``; logits [M, vocab] for the flattened positions in ``logit_rows``."""
        b, s = ids.shape
        io = self.kv_binding(lo, lo + b)
        seqlens = (positions + (s - 1)).astype(np.int32)
        io.bind_cpu_input("input_ids", np.ascontiguousarray(ids, dtype=np.int64))
        io.bind_cpu_input("seqlens_k", seqlens)
        io.bind_cpu_input("total_sequence_length", np.array(int(seqlens.max()) + 1, np.int32))
        io.bind_cpu_input("logit_rows", np.ascontiguousarray(logit_rows, dtype=np.int64))
        logits = np.empty((len(logit_rows), self.vocab_size), np.float32)
        io.bind_output("logits", "cpu", 0, np.float32, logits.shape, logits.ctypes.data)
        self.session.run_with_iobinding(io)
        return logits

    def prefill(self, row: int, tokens: np.ndarray, start: int, last: int = 1) -> np.ndarray:
        """Feed tokens to one row from cache position ``start`` in chunks; the logits of the
        last ``last`` tokens ([last, vocab])."""
        out = []
        n = len(tokens)
        for i in range(0, n, MAX_CHUNK):
            chunk = tokens[i : i + MAX_CHUNK]
            first = max(0, n - last - i)  # positions of this chunk whose logits are wanted
            rows = np.arange(first, len(chunk)) if first < len(chunk) else np.zeros(0, np.int64)
            logits = self.forward(row, chunk[None, :], np.array([start + i]), rows)
            if len(rows):
                out.append(logits)
        return np.concatenate(out) if len(out) > 1 else out[0]
