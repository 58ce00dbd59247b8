"""The client: ``open_card(url)`` gives a Card; a Card opens DraftStreams.

One round of speculative decoding is one ``DraftStream.commit`` call: one frame out, one frame
back. Requests from several threads are pipelined over one link: each request gets a request
id, and whichever waiting thread holds the link's reader role dispatches replies to their
owners by id (no reader thread, so a single-threaded caller never hands off to another thread).
Replies whose id nobody waits for any more (late or duplicate) are counted and dropped.
"""

from __future__ import annotations

import contextlib
import itertools
import struct
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from zlib import crc32

from exstill_sdk.auth import answer, load_admin_key
from exstill_sdk.errors import (
    DeviceLostError,
    ExstillError,
    InvalidArgumentError,
    LinkTimeoutError,
    NoImageStoreError,
    ProtocolError,
    TransportError,
    UnknownModelError,
    error_for_code,
)
from exstill_sdk.protocol import messages as m
from exstill_sdk.protocol.constants import (
    CRC_SIZE,
    FRAME_OVERHEAD,
    HEADER_SIZE,
    PROTOCOL_VERSION,
    RESPONSE_BIT,
    ErrorCode,
    Features,
    ModelKind,
    Opcode,
    OpenFlags,
    WireMode,
)
from exstill_sdk.protocol.frame import CRC, HEADER, seal
from exstill_sdk.protocol.messages import DraftReply as Draft  # tokens, prefetch_hit, dists
from exstill_sdk.transport import TracingTransport, Transport, open_transport

DEFAULT_TIMEOUT = 5.0


@dataclass(frozen=True)
class CardInfo:
    protocol_version: int
    firmware: str
    slots: int
    context: int
    max_k: int
    wire_modes: tuple[WireMode, ...]
    features: Features
    max_payload: int
    engines: tuple[str, ...]
    targets: tuple[m.TargetInfo, ...]


_parse_draft = m.parse_draft_reply_frame


class Card:
    """A connected card. Use as a context manager, or call ``close``."""

    def __init__(
        self,
        transport: Transport,
        timeout: float = DEFAULT_TIMEOUT,
        client: str = "exstill-sdk",
        key: bytes | None = None,
    ) -> None:
        """``key``: the card's admin key (exstill_sdk.auth.load_admin_key); the session proves
        it right after the handshake, so that image-store requests over a network link pass."""
        self._transport = transport
        self._key = key
        self.timeout = timeout
        self._rids = itertools.count(1)
        self._send_lock = threading.Lock()
        self._reader = threading.Lock()
        self._cond = threading.Condition(threading.Lock())
        self._waiting_threads = 0
        self._pending: set[int] = set()
        self._done: dict[int, bytes] = {}
        self.dropped_replies = 0
        """Late, duplicate or corrupt reply frames this client discarded."""
        self._closed = False
        self._client = client
        self._streams: weakref.WeakSet[DraftStream] = weakref.WeakSet()
        try:
            self._info = self._hello(client)
            self._authenticate()
        except BaseException:
            transport.close()
            raise

    @property
    def url(self) -> str:
        return self._transport.url

    # ------------------------------------------------------------ request/reply engine

    def _next_rid(self) -> int:
        # next() on itertools.count is atomic under the GIL; 65,536 ids in flight cannot happen.
        rid = next(self._rids) & 0xFFFF
        self._pending.add(rid)
        return rid

    def _exchange(self, frame: bytes, rid: int, opcode: int, timeout: float | None) -> bytes:
        """Send a request frame and return its checked reply frame (raises the card's error)."""
        deadline = time.monotonic() + (timeout or self.timeout)
        self._send(frame, rid)
        return self._receive(rid, opcode, deadline)

    def _send(self, frame: bytes, rid: int) -> None:
        """Send request ``rid``'s frame; a failed send forgets the request."""
        try:
            with self._send_lock:
                self._transport.send_frame(frame)
        except BaseException:
            self._pending.discard(rid)
            raise

    def _receive(self, rid: int, opcode: int, deadline: float) -> bytes:
        """Request ``rid``'s checked reply frame (raises the card's error)."""
        try:
            reply = self._await(rid, deadline)
        finally:
            self._pending.discard(rid)
        return self._check_reply(reply, opcode)

    def _check_reply(self, reply: bytes, opcode: int) -> bytes:
        """The reply frame if it answers ``opcode``; the card's error, raised, otherwise."""
        op = reply[1]
        if op == opcode | RESPONSE_BIT:
            return reply
        if op == Opcode.ERROR:
            err = m.decode_error_reply(reply[HEADER_SIZE:-CRC_SIZE])
            if err.code == ErrorCode.HANDSHAKE_REQUIRED and opcode != Opcode.HELLO:
                # we did shake hands: the card restarted and forgot this session
                raise DeviceLostError(
                    f"{self.url or 'the card'} restarted (it asks for a new handshake); "
                    "reconnect() and open streams again"
                )
            raise error_for_code(err.code, err.message)
        raise ProtocolError(f"reply opcode 0x{op:02x} does not answer request 0x{opcode:02x}")

    def _await(self, rid: int, deadline: float) -> bytes:
        done = self._done
        while True:
            reply = done.pop(rid, None)
            if reply is not None:
                return reply
            if self._reader.acquire(blocking=False):
                try:
                    return self._read_until(rid, deadline)
                finally:
                    self._reader.release()
                    if self._waiting_threads:
                        with self._cond:
                            self._cond.notify_all()
            with self._cond:
                self._waiting_threads += 1
                try:
                    while rid not in done and self._reader.locked():
                        remaining = deadline - time.monotonic()
                        if remaining <= 0:
                            raise LinkTimeoutError(
                                f"no reply from {self.url or 'the card'} within the timeout"
                            )
                        self._cond.wait(remaining)
                finally:
                    self._waiting_threads -= 1

    def _read_until(self, rid: int, deadline: float) -> bytes:
        """Read frames as the reader until ``rid``'s reply arrives; hand others to their owners."""
        done = self._done
        while True:
            reply = done.pop(rid, None)
            if reply is not None:
                return reply
            frame = self._transport.recv_frame(deadline)
            n = len(frame)
            if (
                n < FRAME_OVERHEAD
                or n != FRAME_OVERHEAD + HEADER.unpack_from(frame)[4]
                or crc32(memoryview(frame)[: n - CRC_SIZE])
                != CRC.unpack_from(frame, n - CRC_SIZE)[0]
                or frame[0] != PROTOCOL_VERSION
            ):
                self.dropped_replies += 1
                continue
            got = frame[2] | frame[3] << 8
            if got == rid:
                return frame
            if got in self._pending and got not in done:
                done[got] = frame
                if self._waiting_threads:
                    with self._cond:
                        self._cond.notify_all()
            else:
                self.dropped_replies += 1

    def _request(
        self, opcode: Opcode, payload: bytes = b"", handle: int = 0, timeout: float | None = None
    ) -> bytes:
        """A control request; returns the reply payload."""
        self._check_open()
        rid = self._next_rid()
        try:
            frame = seal(HEADER.pack(PROTOCOL_VERSION, opcode, rid, handle, len(payload)) + payload)
        except struct.error:
            self._pending.discard(rid)
            raise InvalidArgumentError(f"stream handle {handle!r} is not a u32") from None
        return self._exchange(frame, rid, opcode, timeout)[HEADER_SIZE:-CRC_SIZE]

    def _check_open(self) -> None:
        if self._closed:
            raise ExstillError("this Card is closed; open_card() again")

    # ------------------------------------------------------------ control

    def _hello(self, client: str) -> CardInfo:
        req = m.HelloRequest(PROTOCOL_VERSION, PROTOCOL_VERSION, client)
        reply = m.decode_hello_reply(self._request(Opcode.HELLO, m.encode_hello_request(req)))
        return CardInfo(
            protocol_version=reply.version,
            firmware=reply.firmware,
            slots=reply.slots,
            context=reply.context,
            max_k=reply.max_k,
            wire_modes=tuple(w for w in WireMode if reply.wire_modes >> w & 1),
            features=Features(reply.features),
            max_payload=reply.max_payload,
            engines=reply.engines,
            targets=reply.targets,
        )

    # ------------------------------------------------------------ image store

    def send_pipelined(self, opcode: Opcode, payload: bytes) -> int:
        """Send a request without waiting (pipelining); ``receive_pipelined(rid, opcode)``
        returns its reply payload later. Replies arrive in order of sending."""
        self._check_open()
        rid = self._next_rid()
        self._send(seal(HEADER.pack(PROTOCOL_VERSION, opcode, rid, 0, len(payload)) + payload), rid)
        return rid

    def receive_pipelined(self, rid: int, opcode: Opcode, timeout: float | None = None) -> bytes:
        deadline = time.monotonic() + (timeout or self.timeout)
        return self._receive(rid, opcode, deadline)[HEADER_SIZE:-CRC_SIZE]

    def _store_request(
        self, opcode: Opcode, payload: bytes = b"", timeout: float | None = None
    ) -> bytes:
        """An image-store request, refused here when the card said it has no store."""
        if not self._info.features & Features.IMAGE_STORE:
            raise NoImageStoreError(
                f"{self.url or 'this card'} has no image store, so it cannot take, list or "
                "change flashed images; start the emulator with --store DIR"
            )
        return self._request(opcode, payload, timeout=timeout)

    def upload_begin(self, req: m.UploadBegin) -> tuple[int, int]:
        """Start or resume an upload: (offset to send from, largest chunk)."""
        offset, max_chunk = m.UPLOAD_BEGIN_REPLY.unpack(
            self._store_request(Opcode.UPLOAD_BEGIN, m.encode_upload_begin(req))
        )
        return offset, max_chunk

    def upload_end(self, timeout: float | None = None) -> bytes:
        """Finish the upload; the card checks it in full. Returns the digest it verified."""
        return self._store_request(Opcode.UPLOAD_END, b"", timeout=timeout)

    def activate(self, target: str) -> None:
        """Serve the newly uploaded image of ``target`` on trial (until confirmed)."""
        self._store_request(Opcode.ACTIVATE, m.encode_name(target), timeout=max(self.timeout, 60))

    def confirm(self, target: str) -> None:
        self._store_request(Opcode.CONFIRM, m.encode_name(target))

    def revert(self, target: str) -> None:
        """Drop the image on trial, or go back to the previously confirmed one."""
        self._store_request(Opcode.REVERT, m.encode_name(target), timeout=max(self.timeout, 60))

    def erase(self, target: str) -> None:
        self._store_request(Opcode.ERASE, m.encode_name(target))

    def list_images(self) -> list[m.ImageEntry]:
        return m.decode_image_list(self._store_request(Opcode.LIST_IMAGES))

    def info(self) -> CardInfo:
        """What the card said about itself in the handshake."""
        return self._info

    def stats(self) -> dict[str, int]:
        """The card's telemetry counters (names in docs/protocol.md)."""
        return m.decode_stats_reply(self._request(Opcode.STATS))

    def ping(self, data: bytes = b"") -> float:
        """Round-trip time in seconds of an echo of ``data``."""
        if len(data) > self._info.max_payload:
            raise InvalidArgumentError(
                f"{len(data)} bytes do not fit one frame; the card takes at most "
                f"{self._info.max_payload}"
            )
        start = time.perf_counter()
        if self._request(Opcode.PING, data) != data:
            raise ProtocolError("the card echoed different bytes")
        return time.perf_counter() - start

    def open_stream(
        self,
        engine: str | None = None,
        *,
        target: str | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        max_k: int | None = None,
        wire_mode: WireMode = WireMode.TOKENS,
        long_context: bool = False,
    ) -> DraftStream:
        """Open a stream on a built-in engine or a target image (default: the card's first
        engine). Temperature 0 drafts greedily; otherwise the card samples with these
        parameters from a generator seeded with ``seed``. ``long_context`` lets a target
        stream's context outgrow its slot (the card keeps attention sinks and a sliding
        window; see docs/emulator.md)."""
        if engine is not None and target is not None:
            raise InvalidArgumentError("open a stream on an engine or on a target, not both")
        if target is not None:
            kind, name = ModelKind.TARGET, target
        else:
            if engine is None:
                if not self._info.engines:
                    raise UnknownModelError("this card has no built-in engine; name a target")
                engine = self._info.engines[0]
            kind, name = ModelKind.ENGINE, engine
        req = m.OpenRequest(
            kind=kind,
            name=name,
            wire_mode=wire_mode,
            max_k=max_k or 0,
            top_k=top_k,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            flags=OpenFlags.LONG_CONTEXT if long_context else 0,
        )
        reply = m.decode_open_reply(self._request(Opcode.OPEN, m.encode_open_request(req)))
        capacity = (1 << 62) if long_context else reply.context
        stream = DraftStream(self, reply.handle, capacity, reply.max_k, name)
        self._streams.add(stream)
        return stream

    def reconnect(self) -> None:
        """Open the link again (same URL) and shake hands, after a DeviceLostError. Streams
        opened before are gone on the card; their DraftStream objects are marked closed."""
        if not self.url:
            raise TransportError("this Card was made from a transport, not a URL: reopen it")
        for stream in list(self._streams):
            stream.closed = True
        self._streams.clear()
        with contextlib.suppress(ExstillError, OSError):
            self._transport.close()
        tracing = isinstance(self._transport, TracingTransport)
        transport = open_transport(self.url, self.timeout)
        self._transport = TracingTransport(transport) if tracing else transport
        self._pending.clear()
        self._done.clear()
        self._closed = False
        self._info = self._hello(self._client)
        self._authenticate()

    def _authenticate(self) -> None:
        """Prove the admin key, if this Card has one: a fresh challenge, answered once."""
        if self._key is not None:
            nonce = self._request(Opcode.AUTH_CHALLENGE)
            self._request(Opcode.AUTH, answer(self._key, nonce))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._transport.close()

    def __enter__(self) -> Card:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class DraftStream:
    """One sequence's drafting state on the card: a slot holding its committed context.

    The host mirrors the committed length. If a request times out its effect on the card is
    unknown, so the stream resynchronises (a rollback to the host's length) before the next
    request.
    """

    def __init__(self, card: Card, handle: int, capacity: int, max_k: int, model: str) -> None:
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
            card._pending.discard(rid)
            raise InvalidArgumentError(f"K must be 0..255, not {k!r}") from None
        result = _parse_draft(self._exchange(frame, rid, Opcode.DRAFT, timeout))
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
            card._pending.discard(rid)
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
        result = _parse_draft(reply)
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


def open_card(
    url: str = "emu://",
    timeout: float = DEFAULT_TIMEOUT,
    trace: bool = False,
    key: str | Path | bytes | None = None,
) -> Card:
    """Connect to the card a URL names and shake hands.

    ``emu://`` runs the card runtime in this process; ``tcp://HOST:PORT`` reaches a card server
    such as ``exstill-emu``. ``trace=True`` logs every frame, decoded, to the
    ``exstill_sdk.trace`` logger at DEBUG level. ``key``: the card's admin key (a key file's
    path, or its bytes), which a network link needs for image-store requests.
    """
    secret = None if key is None else load_admin_key(key)
    transport = open_transport(url, timeout)
    if trace:
        transport = TracingTransport(transport)
    return Card(transport, timeout, key=secret)
