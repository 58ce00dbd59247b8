"""The client: ``open_card(url)`` gives a Card; a Card opens DraftStreams.

One round of speculative decoding is one ``DraftStream.commit`` call: one frame out, one frame
back. Requests from several threads are pipelined over one link (replies.py); the image-store
requests are image_store.py's.
"""

from __future__ import annotations

import contextlib
import itertools
import struct
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

from exstill_sdk.auth import load_admin_key
from exstill_sdk.errors import (
    DeviceLostError,
    ExstillError,
    InvalidArgumentError,
    LinkTimeoutError,
    ProtocolError,
    TransportError,
    UnknownModelError,
    error_for_code,
)
from exstill_sdk.image_store import ImageStoreRequests
from exstill_sdk.interface import CardInfo
from exstill_sdk.protocol import messages as m
from exstill_sdk.protocol.auth import answer
from exstill_sdk.protocol.constants import (
    CRC_SIZE,
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
from exstill_sdk.protocol.drafts import Draft
from exstill_sdk.protocol.frame import pack_frame
from exstill_sdk.replies import ReplyMultiplexer
from exstill_sdk.stream import DraftStream
from exstill_sdk.transport import TracingTransport, Transport, open_transport

DEFAULT_TIMEOUT = 5.0
HANDSHAKE_TIMEOUT = 5.0
"""The most a handshake waits, whatever the timeout chosen for requests."""


class Card(ImageStoreRequests):
    """A connected card. Use as a context manager, or call ``close``."""

    _info: CardInfo

    def __init__(
        self,
        transport: Transport,
        timeout: float = DEFAULT_TIMEOUT,
        client: str = "exstill-sdk",
        key: bytes | None = None,
    ) -> None:
        """``key``: the card's admin key (exstill_sdk.auth.load_admin_key); the session proves
        it right after the handshake, so that image-store requests over a network link pass."""
        self._rids = itertools.count(1)
        """Request ids, continued across reconnects: a reply awaited on the link before cannot
        be taken for a request on the new one."""
        self._mux = ReplyMultiplexer(transport, self._rids)
        self._key = key
        self.timeout = timeout
        self._closed = False
        self._client = client
        self._streams: weakref.WeakSet[DraftStream] = weakref.WeakSet()
        self._held: list[tuple[bytes, int]] | None = None
        self._held_by = 0
        """The thread whose sent_together block holds its requests back (other threads' go
        out at once)."""
        self._together = threading.Lock()
        self._lost: DeviceLostError | None = None
        """Why the link is known dead (until ``reconnect``): every request then fails at once,
        so that one lost card of a pool costs no waiting."""
        try:
            self._info = self._hello(client)
            self._authenticate()
        except BaseException:
            transport.close()
            raise

    @property
    def url(self) -> str:
        return self.transport.url

    @property
    def transport(self) -> Transport:
        """The link this card is reached over (a new one after ``reconnect``)."""
        return self._mux.transport

    @property
    def dropped_replies(self) -> int:
        """Late, duplicate or corrupt reply frames this client discarded."""
        return self._mux.dropped

    # ------------------------------------------------------------ requests and replies
    # The request path (stream.RequestPath) that streams and the image store use.

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def max_payload(self) -> int:
        """The largest payload the card takes in one frame."""
        return self._info.max_payload

    def next_rid(self) -> int:
        """A request id, now awaited (``forget`` it if the request is not sent)."""
        return self._mux.next_rid()

    def forget(self, rid: int) -> None:
        """Stop awaiting request ``rid``: its reply, if one comes, is dropped."""
        self._mux.forget(rid)

    def exchange(self, frame: bytes, rid: int, opcode: int, timeout: float | None) -> bytes:
        """Send a request frame and return its checked reply frame (raises the card's error)."""
        if self._held is not None and self._held_by == threading.get_ident():
            self._mux.forget(rid)
            raise InvalidArgumentError("a request that waits for its reply cannot be held back")
        deadline = time.monotonic() + (timeout or self.timeout)
        self.send(frame, rid)
        return self.receive(rid, opcode, deadline)

    def send(self, frame: bytes, rid: int) -> None:
        if self._held is not None and self._held_by == threading.get_ident():
            self._held.append((frame, rid))
            return
        mux = self._mux
        if self._lost is not None:
            mux.forget(rid)
            raise DeviceLostError(str(self._lost))
        try:
            mux.send(frame, rid)
        except DeviceLostError as exc:
            self._lose(mux, exc)
            raise

    def _lose(self, mux: ReplyMultiplexer, exc: DeviceLostError) -> None:
        """The link ``mux`` serves is lost, unless another thread has reopened it since."""
        if mux is self._mux:
            self._lost = exc

    @contextlib.contextmanager
    def sent_together(self) -> Iterator[None]:
        """Requests sent inside (without waiting for their replies: ``send_commit``) go out
        in one write when the block ends, so that the card reads them together: the rounds of
        a batch are then drafted as one batch. Waiting for a reply inside is an error."""
        if self._held is not None and self._held_by == threading.get_ident():
            raise InvalidArgumentError("sent_together blocks do not nest")
        with self._together:  # one thread's block at a time; other threads send at once
            self._held, self._held_by = [], threading.get_ident()
            try:
                yield
            finally:
                held, self._held = self._held, None
                mux = self._mux
                if held and self._lost is None:
                    try:
                        mux.send_many(held)
                    except DeviceLostError as exc:
                        self._lose(mux, exc)
                        raise

    def receive(self, rid: int, opcode: int, deadline: float) -> bytes:
        """Request ``rid``'s checked reply frame (raises the card's error)."""
        mux = self._mux
        if self._lost is not None:
            mux.forget(rid)
            raise DeviceLostError(str(self._lost))
        try:
            return self._check_reply(mux.receive(rid, deadline), opcode)
        except DeviceLostError as exc:
            self._lose(mux, exc)
            raise

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

    def request(
        self, opcode: Opcode, payload: bytes = b"", handle: int = 0, timeout: float | None = None
    ) -> bytes:
        """A control request; returns the reply payload."""
        self.check_open()
        rid = self.next_rid()
        try:
            frame = pack_frame(opcode, rid, handle, payload)
        except struct.error:
            self._mux.forget(rid)
            raise InvalidArgumentError(f"stream handle {handle!r} is not a u32") from None
        return self.exchange(frame, rid, opcode, timeout)[HEADER_SIZE:-CRC_SIZE]

    def check_open(self) -> None:
        if self._closed:
            raise ExstillError("this Card is closed; open_card() again")

    # ------------------------------------------------------------ control

    def _hello(self, client: str) -> CardInfo:
        """The handshake, within HANDSHAKE_TIMEOUT (a card answers it at once; a long timeout
        chosen for transfers must not make a silent server look like a slow card)."""
        req = m.HelloRequest(PROTOCOL_VERSION, PROTOCOL_VERSION, client)
        try:
            payload = self.request(
                Opcode.HELLO,
                m.encode_hello_request(req),
                timeout=min(self.timeout, HANDSHAKE_TIMEOUT),
            )
        except LinkTimeoutError:
            raise LinkTimeoutError(
                f"{self.url or 'the link'} did not answer the handshake within "
                f"{min(self.timeout, HANDSHAKE_TIMEOUT):g} s: is it an Exstill card, and is it "
                "running?"
            ) from None
        reply = m.decode_hello_reply(payload)
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
        self.check_open()
        rid = self.next_rid()
        self.send(pack_frame(opcode, rid, 0, payload), rid)
        return rid

    def receive_pipelined(self, rid: int, opcode: Opcode, timeout: float | None = None) -> bytes:
        deadline = time.monotonic() + (timeout or self.timeout)
        return self.receive(rid, opcode, deadline)[HEADER_SIZE:-CRC_SIZE]

    def info(self) -> CardInfo:
        """What the card said about itself in the handshake."""
        return self._info

    def stats(self) -> dict[str, int]:
        """The card's telemetry counters (names in docs/protocol.md)."""
        return m.decode_stats_reply(self.request(Opcode.STATS))

    def ping(self, data: bytes = b"") -> float:
        """Round-trip time in seconds of an echo of ``data``."""
        if len(data) > self._info.max_payload:
            raise InvalidArgumentError(
                f"{len(data)} bytes do not fit one frame; the card takes at most "
                f"{self._info.max_payload}"
            )
        start = time.perf_counter()
        if self.request(Opcode.PING, data) != data:
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
        lookup: bool = False,
    ) -> DraftStream:
        """Open a stream on a built-in engine or a target image (default: the card's first
        engine). Temperature 0 drafts greedily; otherwise the card samples with these
        parameters from a generator seeded with ``seed``. ``long_context`` lets a target
        stream's context outgrow its slot (the card keeps attention sinks and a sliding
        window; see docs/emulator.md). ``lookup``: a target stream drafts by prompt lookup
        where its text repeats and by the model elsewhere (not with ``long_context``)."""
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
            flags=(OpenFlags.LONG_CONTEXT if long_context else 0)
            | (OpenFlags.LOOKUP if lookup else 0),
        )
        reply = m.decode_open_reply(self.request(Opcode.OPEN, m.encode_open_request(req)))
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
            stream.mark_lost()
        self._streams.clear()
        with contextlib.suppress(ExstillError, OSError):
            self.transport.close()
        tracing = isinstance(self.transport, TracingTransport)
        transport = open_transport(self.url, self.timeout)
        self._mux = ReplyMultiplexer(
            TracingTransport(transport) if tracing else transport, self._rids
        )
        self._closed = False
        self._lost = None
        self._info = self._hello(self._client)
        self._authenticate()

    def _authenticate(self) -> None:
        """Prove the admin key, if this Card has one: a fresh challenge, answered once."""
        if self._key is not None:
            nonce = self.request(Opcode.AUTH_CHALLENGE)
            self.request(Opcode.AUTH, answer(self._key, nonce))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.transport.close()

    def __enter__(self) -> Card:
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


__all__ = ["Card", "CardInfo", "Draft", "DraftStream", "open_card"]
