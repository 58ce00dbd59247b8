"""Serving a card runtime on one host link: the loop body every link shares (TCP, serial, USB).

A link hands the runtime whole frames and sends back what it answers. On a byte stream (TCP,
serial) ``feed`` takes what one read delivered, deframes it (COBS), serves every whole frame
in order (``CardRuntime.handle_many``: the COMMITs of one read that need a fresh draft are
drafted together) and returns the replies of that read as one write; the deframer's drops
are counted in the card's telemetry. A link that carries whole frames (USB bulk transfers)
calls ``handle``. After the replies are out the caller runs the runtime's prefetch work
(``after_replies``), so the card drafts ahead while the host verifies.

A point-to-point link (serial, USB) cannot tell that its host went away, so there a HELLO
starts a fresh session and the previous session's streams are closed, as a card does when its
host reboots; only a whole frame that passes its CRC counts as a HELLO, so line noise that
happens to carry the HELLO opcode drops nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from exstill_sdk.protocol.constants import Opcode
from exstill_sdk.protocol.frame import is_whole_frame
from exstill_sdk.protocol.framing import Deframer, encode_stream_frame

from ..runtime import CardRuntime
from ..streams import LOCAL


class HostLink:
    def __init__(
        self, runtime: CardRuntime, name: str, link: str = LOCAL, *, single_host: bool = False
    ) -> None:
        """``link``: who may be at the other end (streams.LOCAL, NETWORK, REMOTE);
        ``single_host``: a point-to-point link, where a HELLO starts a fresh session."""
        self.runtime = runtime
        self.name = name
        self.link = link
        self.single_host = single_host
        self.session = runtime.open_session(name, link)
        self._deframer = Deframer()

    def handle(self, frame: bytes) -> bytes | None:
        """Serve one frame; the reply frame, or None for a frame the card drops."""
        if self.single_host and frame[1:2] == _HELLO and is_whole_frame(frame):
            self.runtime.close_session(self.session)
            self.session = self.runtime.open_session(self.name, self.link)
        return self.runtime.handle(self.session, frame)

    def feed(self, data: bytes | bytearray) -> bytes:
        """Serve the frames completed by one read of a byte stream; the bytes to write back
        (every reply of the read, COBS-framed, in one buffer; empty when there is none)."""
        deframer = self._deframer
        frames = deframer.feed(data)
        if self.single_host and any(f[1:2] == _HELLO for f in frames):
            served = [r for r in map(self.handle, frames) if r is not None]
        else:  # the frames of one read together: a batch's rounds are drafted as one
            served = self.runtime.handle_many(self.session, frames)
        replies = [encode_stream_frame(reply) for reply in served]
        if deframer.dropped:
            self.runtime.telemetry.frames_dropped += deframer.dropped
            deframer.dropped = 0
        return replies[0] if len(replies) == 1 else b"".join(replies)

    def after_replies(self, stop: Callable[[], bool] | None = None) -> None:
        """Draft ahead while the host verifies (the runtime's queued prefetch work);
        ``stop``: whether the host's next bytes are waiting to be read."""
        self.runtime.run_prefetch(stop)

    def close(self) -> None:
        """The host is gone: its streams are freed."""
        self.runtime.close_session(self.session)


_HELLO = bytes([Opcode.HELLO])
