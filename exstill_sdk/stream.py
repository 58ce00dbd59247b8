"""A stream on the card: one sequence's drafting state, and the round (COMMIT) that moves it.

One round of speculative decoding is one ``DraftStream.commit``: one frame out, one frame back;
``send_commit`` and ``receive_commit`` split it so that several streams' rounds travel together.
"""

from __future__ import annotations

import struct
import time
from types import TracebackType
from typing import Protocol

from exstill_sdk.errors import ExstillError, InvalidArgumentError, LinkTimeoutError
from exstill_sdk.protocol import messages as m
from exstill_sdk.protocol.constants import CRC_SIZE, HEADER_SIZE, PROTOCOL_VERSION, Opcode
from exstill_sdk.protocol.frame import HEADER, seal
from exstill_sdk.protocol.messages import DraftReply as Draft
from exstill_sdk.replies import ReplyMultiplexer


class _Handshake(Protocol):
    @property
    def max_payload(self) -> int: ...


class StreamLink(Protocol):
    """What a stream needs of its Card: the card's request path."""

    timeout: float
    _closed: bool
    _mux: ReplyMultiplexer

    @property
    def _info(self) -> _Handshake: ...

    def _check_open(self) -> None: ...

    def _next_rid(self) -> int: ...

    def _send(self, frame: bytes, rid: int) -> None: ...

    def _receive(self, rid: int, opcode: int, deadline: float) -> bytes: ...

    def _exchange(self, frame: bytes, rid: int, opcode: int, timeout: float | None) -> bytes: ...

    def _request(
        self, opcode: Opcode, payload: bytes = b"", handle: int = 0, timeout: float | None = None
    ) -> bytes: ...


class DraftStream:
    """One sequence's drafting state on the card: a slot holding its committed context.

    The host mirrors the committed length. If a request times out its effect on the card is
    unknown, so the stream resynchronises (a rollback to the host's length) before the next
    request.
    """

    def __init__(
        self, card: StreamLink, handle: int, capacity: int, max_k: int, model: str
    ) -> None:
        self.card = card
        self.handle = handle
        self.capacity = capacity
        self.max_k = max_k
        self.model = model
        self.length = 0
        self.last_draft: tuple[int, ...] = ()
        self._resync = False
        self.closed = False

    def _guard(self) -> None:
        if self.closed:
            raise ExstillError("this stream is closed; open a new one")
        if self._resync:
            self._do_rollback(self.length)
            self._resync = False

    def _exchange(self, frame: bytes, rid: int, opcode: int, timeout: float | None) -> bytes:
        """The card's reply frame; a timeout leaves the card's state unknown, so the stream
        resynchronises before its next request."""
        try:
            return self.card._exchange(frame, rid, opcode, timeout)
        except LinkTimeoutError:
            self._resync = True
            raise

    def _request(self, opcode: Opcode, payload: bytes, timeout: float | None) -> bytes:
        """A non-round request on this stream; the reply payload. Timeouts as in _exchange."""
        try:
            return self.card._request(opcode, payload, self.handle, timeout)
        except LinkTimeoutError:
            self._resync = True
            raise

    def prefill(self, tokens: list[int] | tuple[int, ...], timeout: float | None = None) -> int:
        """Append prompt tokens, in chunks that fit a frame; returns the new length."""
        self._guard()
        if self.length + len(tokens) > self.capacity:
            raise InvalidArgumentError(
                f"{len(tokens)} tokens do not fit: the stream holds {self.length} of "
                f"{self.capacity}"
            )
        chunk = self.card._info.max_payload // 4
        for start in range(0, len(tokens), chunk):
            part = m.encode_tokens(tokens[start : start + chunk])
            self.length = m.decode_u32(self._request(Opcode.PREFILL, part, timeout))
        self.last_draft = ()
        return self.length

    def send_prefill(self, tokens: list[int] | tuple[int, ...]) -> int:
        """Append tokens without waiting for the card (one frame's worth at most): the card
        takes them in while the host works on. ``receive_prefill`` with the returned request
        id completes it; requests sent on the stream meanwhile are served after it, in order."""
        self._guard()
        if len(tokens) > self.card._info.max_payload // 4:
            raise InvalidArgumentError(
                f"{len(tokens)} tokens do not fit one frame; use prefill() for long runs"
            )
        card = self.card
        card._check_open()
        rid = card._next_rid()
        payload = m.encode_tokens(tokens)
        frame = seal(
            HEADER.pack(PROTOCOL_VERSION, Opcode.PREFILL, rid, self.handle, len(payload)) + payload
        )
        try:
            card._send(frame, rid)
        except LinkTimeoutError:
            self._resync = True
            raise
        return rid

    def receive_prefill(self, rid: int, timeout: float | None = None) -> int:
        """The second half of ``send_prefill``: the stream's new length."""
        deadline = time.monotonic() + (timeout or self.card.timeout)
        try:
            reply = self.card._receive(rid, Opcode.PREFILL, deadline)
        except LinkTimeoutError:
            self._resync = True
            raise
        self.length = m.decode_u32(reply[HEADER_SIZE:-CRC_SIZE])
        self.last_draft = ()
        return self.length

    def draft(self, k: int, timeout: float | None = None) -> Draft:
        """Propose up to ``k`` tokens after the committed context."""
        self._guard()
        card = self.card
        card._check_open()
        rid = card._next_rid()
        try:
            frame = m.draft_frame(rid, self.handle, k)
        except struct.error:
            card._mux.forget(rid)
            raise InvalidArgumentError(f"K must be 0..255, not {k!r}") from None
        result = m.parse_draft_reply_frame(self._exchange(frame, rid, Opcode.DRAFT, timeout))
        self.last_draft = result.tokens
        return result

    def commit(self, accepted: int, bonus: int, next_k: int, timeout: float | None = None) -> Draft:
        """One verification round: the target accepted the first ``accepted`` tokens of the last
        draft, then produced ``bonus``; returns the next draft of up to ``next_k`` tokens."""
        deadline = time.monotonic() + (timeout or self.card.timeout)  # counted from the send
        return self._commit_reply(self.send_commit(accepted, bonus, next_k), accepted, deadline)

    def send_commit(self, accepted: int, bonus: int, next_k: int) -> int:
        """The first half of ``commit``: send the round without waiting for the reply, so that
        several streams' rounds travel together; ``receive_commit`` with the returned request
        id (and the same ``accepted``) completes it."""
        if self._resync or self.closed:
            self._guard()
        if not 0 <= accepted <= len(self.last_draft):
            raise InvalidArgumentError(
                f"accepted {accepted} but the last draft had {len(self.last_draft)} tokens"
            )
        card = self.card
        if card._closed:
            card._check_open()
        rid = card._next_rid()
        try:
            frame = m.commit_frame(rid, self.handle, accepted, next_k, bonus)
        except struct.error:
            card._mux.forget(rid)
            raise InvalidArgumentError(
                f"bonus must be a u32 token id and next K 0..255 (got {bonus!r}, {next_k!r})"
            ) from None
        try:
            card._send(frame, rid)
        except LinkTimeoutError:  # the card may have the round: resynchronise before the next
            self._resync = True
            raise
        return rid

    def receive_commit(self, rid: int, accepted: int, timeout: float | None = None) -> Draft:
        """The second half of ``commit``: the next draft. A timeout leaves the card's state
        unknown, so the stream resynchronises before its next request."""
        deadline = time.monotonic() + (timeout or self.card.timeout)
        return self._commit_reply(rid, accepted, deadline)

    def _commit_reply(self, rid: int, accepted: int, deadline: float) -> Draft:
        try:
            reply = self.card._receive(rid, Opcode.COMMIT, deadline)
        except LinkTimeoutError:
            self._resync = True
            raise
        result = m.parse_draft_reply_frame(reply)
        self.length += accepted + 1
        self.last_draft = result.tokens
        return result

    def _do_rollback(self, length: int, timeout: float | None = None) -> int:
        self.length = m.decode_u32(self._request(Opcode.ROLLBACK, m.encode_u32(length), timeout))
        self.last_draft = ()
        return self.length

    def rollback(self, length: int, timeout: float | None = None) -> int:
        """Cut the committed context back to ``length`` tokens."""
        self._guard()
        if not 0 <= length <= self.length:
            raise InvalidArgumentError(
                f"cannot roll back to {length}: the stream holds {self.length} tokens"
            )
        return self._do_rollback(length, timeout)

    def close(self) -> None:
        """Free the card's slot; safe to call twice and after the card is gone."""
        if self.closed:
            return
        self.closed = True
        if not self.card._closed:
            self.card._request(Opcode.CLOSE, b"", self.handle)

    def __enter__(self) -> DraftStream:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
