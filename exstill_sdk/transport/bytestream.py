"""Shared machinery for links that carry a byte stream (TCP now, serial next): COBS framing
on the way out, a Deframer on the way in, one reused receive buffer."""

from __future__ import annotations

from abc import abstractmethod
from collections import deque

from exstill_sdk.protocol.framing import Deframer, encode_stream_frame
from exstill_sdk.transport.base import Transport

RECV_BUFFER = 1 << 16


class ByteStreamTransport(Transport):
    def __init__(self) -> None:
        self._deframer = Deframer()
        self._frames: deque[bytes] = deque()
        self._buffer = bytearray(RECV_BUFFER)
        self._view = memoryview(self._buffer)

    @property
    def dropped(self) -> int:
        """Byte runs discarded as undecodable since the link opened."""
        return self._deframer.dropped

    def send_frame(self, frame: bytes) -> None:
        self._write(encode_stream_frame(frame))

    def recv_frame(self, deadline: float) -> bytes:
        frames = self._frames
        while not frames:
            n = self._read_into(self._view, deadline)
            frames.extend(self._deframer.feed(self._buffer[:n]))
        return frames.popleft()

    @abstractmethod
    def _write(self, data: bytes) -> None:
        """Write all of ``data`` in one call to the link."""

    @abstractmethod
    def _read_into(self, view: memoryview, deadline: float) -> int:
        """Read what is available (at least one byte) into ``view``; the count read.
        LinkTimeoutError after ``deadline``, TransportError when the link is gone."""
