"""Shared machinery for links that carry a byte stream (TCP, serial): COBS framing on the way
out, a Deframer on the way in, one reused receive buffer."""

from __future__ import annotations

from abc import abstractmethod
from collections import deque
from collections.abc import Sequence

from exstill_sdk.errors import DeviceLostError, NotACardError
from exstill_sdk.protocol.constants import PROTOCOL_VERSION
from exstill_sdk.protocol.framing import Deframer, encode_stream_frame
from exstill_sdk.transport.base import Transport

RECV_BUFFER = 1 << 16
GREETING_SHOWN = 24
"""Bytes of a non-card's answer shown in NotACardError."""


def _could_begin_a_frame(head: bytes) -> bool:
    """Whether the first bytes of a link (idle 0x00 fill skipped) can begin a COBS-encoded
    card frame: a code byte of at least 2 (the version byte is not zero), then the version."""
    if not head:
        return True
    if head[0] < 2:
        return False
    return len(head) < 2 or head[1] == PROTOCOL_VERSION


class ByteStreamTransport(Transport):
    sniff_greeting = False
    """Check the first bytes the link delivers, and raise NotACardError at once when they
    cannot begin a card's frame (a network address that another service answers). Off where
    line noise at open is normal (serial): the deframer resynchronises there."""

    def __init__(self) -> None:
        self._deframer = Deframer()
        self._frames: deque[bytes] = deque()
        self._buffer = bytearray(RECV_BUFFER)
        self._view = memoryview(self._buffer)
        self._greeting: bytearray | None = bytearray() if self.sniff_greeting else None

    @property
    def dropped(self) -> int:
        """Byte runs discarded as undecodable since the link opened."""
        return self._deframer.dropped

    def send_frame(self, frame: bytes) -> None:
        self._write(encode_stream_frame(frame))

    def send_frames(self, frames: Sequence[bytes]) -> None:
        self._write(b"".join(map(encode_stream_frame, frames)))

    def recv_frame(self, deadline: float) -> bytes:
        frames = self._frames
        while not frames:
            if self._greeting is not None:
                return self._recv_first_frame(deadline)
            n = self._read_into(self._view, deadline)
            frames.extend(self._deframer.feed(self._buffer[:n]))
        return frames.popleft()

    def _recv_first_frame(self, deadline: float) -> bytes:
        greeting = self._greeting
        assert greeting is not None
        frames = self._frames
        while not frames:
            try:
                n = self._read_into(self._view, deadline)
            except DeviceLostError:
                if greeting.lstrip(b"\0"):
                    raise self._not_a_card() from None
                raise
            chunk = bytes(self._buffer[:n])
            if len(greeting) < GREETING_SHOWN:
                greeting += chunk[: GREETING_SHOWN - len(greeting)]
            if not _could_begin_a_frame(bytes(greeting.lstrip(b"\0"))):
                raise self._not_a_card()
            frames.extend(self._deframer.feed(chunk))
        self._greeting = None
        return frames.popleft()

    def _not_a_card(self) -> NotACardError:
        assert self._greeting is not None
        shown = "".join(chr(b) if 32 <= b < 127 else "." for b in self._greeting)
        return NotACardError(
            f"{self.url or 'the link'} answered, but not as an Exstill card (it sent "
            f"{shown!r}); check the host and port"
        )

    @abstractmethod
    def _write(self, data: bytes) -> None:
        """Write all of ``data`` in one call to the link."""

    @abstractmethod
    def _read_into(self, view: memoryview, deadline: float) -> int:
        """Read what is available (at least one byte) into ``view``; the count read.
        LinkTimeoutError after ``deadline``, TransportError when the link is gone."""
