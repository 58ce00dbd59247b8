"""Byte-stream framing: COBS-encoded frames, each followed by a 0x00 delimiter.

COBS removes every zero byte from a frame, so 0x00 only ever marks a frame boundary and a
receiver resynchronises at the next delimiter after any corruption. Overhead is one byte per
254 plus the delimiter: two bytes for every per-round frame. USB and the in-process emulator
carry whole frames and do not use this.
"""

from __future__ import annotations

from cobs import cobs

from exstill_sdk.protocol.constants import MAX_FRAME

DELIMITER = b"\x00"
MAX_ENCODED = MAX_FRAME + MAX_FRAME // 254 + 2
"""Longest COBS text of a valid frame; longer runs between delimiters are discarded."""


def encode_stream_frame(frame: bytes) -> bytes:
    return cobs.encode(frame) + DELIMITER


class Deframer:
    """Turns arbitrary chunks of a byte stream into frames; drops what cannot be a frame.

    ``feed`` returns the frames completed by a chunk. Undecodable or oversize runs are counted
    in ``dropped`` and skipped; the next delimiter starts a clean frame.
    """

    __slots__ = ("_discarding", "_pending", "dropped")

    def __init__(self) -> None:
        self._pending = bytearray()
        self._discarding = False
        self.dropped = 0

    def feed(self, chunk: bytes | bytearray) -> list[bytes]:
        if not self._pending and not self._discarding and chunk[-1:] == DELIMITER:
            # Fast path: the chunk holds whole frames and nothing is pending.
            parts = chunk.split(DELIMITER)
            parts.pop()
            return [f for f in map(self._decode, parts) if f is not None]
        frames: list[bytes] = []
        pending = self._pending
        pending += chunk
        while True:
            end = pending.find(0)
            if end < 0:
                if len(pending) > MAX_ENCODED:
                    self._discarding = True
                    pending.clear()
                return frames
            text = bytes(pending[:end])
            del pending[: end + 1]
            if self._discarding:
                self._discarding = False
                self.dropped += 1
                continue
            frame = self._decode(text)
            if frame is not None:
                frames.append(frame)

    def _decode(self, text: bytes | bytearray) -> bytes | None:
        if not text:
            return None  # back-to-back delimiters are idle fill, not a frame
        if len(text) > MAX_ENCODED:
            self.dropped += 1
            return None
        try:
            return cobs.decode(text)
        except cobs.DecodeError:
            self.dropped += 1
            return None
