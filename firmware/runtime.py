"""The card runtime: frames in, frames out, for any number of client sessions.

This module is the dispatcher: frame checks, sessions and the handshake, authentication,
telemetry of frames, one reply sealer; every request on a stream is the stream service's
(stream_service.py).

``CardRuntime.handle(session, frame)`` is the whole interface a transport needs: it parses and
checks one frame and returns the reply frame, or None when the frame must be dropped (bad CRC,
bad length: its request id cannot be trusted). Every other kind of bad input gets an ERROR
reply; nothing a client sends can raise out of ``handle`` or change another client's streams.
Requests are served one at a time under a lock (the card's scheduler); the prefetch worker
drafts ahead in the background between them.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
from collections.abc import Callable, Iterable
from typing import NamedTuple
from zlib import crc32

from exstill_sdk.errors import (
    ExstillError,
    InvalidArgumentError,
    NotAuthorizedError,
    ProtocolError,
)
from exstill_sdk.protocol import messages as m
from exstill_sdk.protocol.auth import answer
from exstill_sdk.protocol.constants import (
    ADMIN_OPCODES,
    AUTH_NONCE_SIZE,
    CRC_SIZE,
    FRAME_OVERHEAD,
    HEADER_SIZE,
    MAX_PAYLOAD,
    PROTOCOL_VERSION,
    RESPONSE_BIT,
    STORE_OPCODES,
    ErrorCode,
    Features,
    ModelKind,
    Opcode,
    WireMode,
)
from exstill_sdk.protocol.frame import CRC, HEADER, pack_frame

from .engines import DraftEngine, LookupEngine
from .flashing import StoreService, transformer_factory
from .prefetch import Prefetcher
from .store import Store
from .stream_service import Deferred, StreamService
from .streams import LOCAL, NETWORK, REMOTE, Session, StreamTable
from .telemetry import Telemetry
from .version import __version__

log = logging.getLogger(__name__)

DEFAULT_SLOTS = 12
DEFAULT_CONTEXT = 16384
DEFAULT_MAX_K = 16
MAX_K_LIMIT = 64

Handler = Callable[[Session, int, bytes], "bytes | Deferred"]
"""A request's handler: the reply payload, or a COMMIT's deferred draft (stream_service.py)."""
_GUARDED = {
    NETWORK: ADMIN_OPCODES,
    REMOTE: frozenset(Opcode) - {Opcode.HELLO, Opcode.PING, Opcode.AUTH_CHALLENGE, Opcode.AUTH},
}
"""Per link kind, the requests that need an authenticated session."""
_NEEDS_HANDSHAKE = frozenset(
    {Opcode.OPEN, Opcode.CLOSE, Opcode.PREFILL, Opcode.DRAFT, Opcode.COMMIT, Opcode.ROLLBACK}
    | {Opcode.DRAFT_TREE, Opcode.COMMIT_TREE}
    | STORE_OPCODES
)
"""Requests a session may make only after its HELLO."""


class _Waiting(NamedTuple):
    """A COMMIT of one read served but for its draft: where its reply goes."""

    commit: Deferred
    rid: int
    handle: int


class CardRuntime:
    def __init__(
        self,
        slots: int = DEFAULT_SLOTS,
        context: int = DEFAULT_CONTEXT,
        engines: Iterable[DraftEngine] | None = None,
        max_k: int = DEFAULT_MAX_K,
        prefetch: bool = True,
        background_prefetch: bool = True,
        store: Store | None = None,
        threads: int = 0,
        admin_key: bytes | None = None,
        prefetch_outcomes: bool = True,
    ) -> None:
        """``prefetch`` drafts ahead between rounds; with ``background_prefetch`` a worker
        thread does it, otherwise the serving loop calls ``run_prefetch`` when idle;
        ``prefetch_outcomes`` drafts ahead for other verification outcomes too, not only the
        full-acceptance one (firmware/outcomes.py).
        ``threads``: compute threads of the transformer engines made for flashed images.
        ``admin_key``: the secret a network session must prove (AUTH) before administration;
        without one, network sessions cannot administer the card at all."""
        if not 16 <= context <= 1 << 24:
            raise InvalidArgumentError(
                f"context per slot must be 16..{1 << 24} tokens, not {context}"
            )
        if not 1 <= max_k <= MAX_K_LIMIT:
            raise InvalidArgumentError(f"max K must be 1..{MAX_K_LIMIT}, not {max_k}")
        self.context = context
        self.max_k = max_k
        self.streams = StreamTable(slots)
        self.models: dict[str, DraftEngine] = {
            e.name: e for e in (engines if engines is not None else [LookupEngine()])
        }
        self.telemetry = Telemetry()
        self.prefetcher = (
            Prefetcher(background_prefetch, prefetch_outcomes, self.telemetry) if prefetch else None
        )
        self.stream_service = StreamService(
            self.streams, self.models, self.telemetry, self.prefetcher, context, max_k
        )
        self._lock = threading.Lock()
        self._batching = False
        """Inside handle_many: COMMITs that need a fresh draft defer it (``Deferred``)."""
        service = self.stream_service
        self._handlers: dict[int, Handler] = {
            Opcode.HELLO: self._hello,
            Opcode.PING: self._ping,
            Opcode.STATS: self._stats,
            Opcode.AUTH_CHALLENGE: self._auth_challenge,
            Opcode.AUTH: self._auth,
            Opcode.OPEN: service.open,
            Opcode.CLOSE: service.close,
            Opcode.PREFILL: service.prefill,
            Opcode.DRAFT: service.draft,
            Opcode.COMMIT: self._commit,
            Opcode.ROLLBACK: service.rollback,
            Opcode.DRAFT_TREE: service.draft_tree,
            Opcode.COMMIT_TREE: service.commit_tree,
        }
        self.admin_key = admin_key
        self.store = None
        if store is not None:
            self.store = StoreService(
                self.models, self.telemetry, store, transformer_factory(slots, context, threads)
            )
            self._handlers.update(self.store.handlers())

    # ------------------------------------------------------------ sessions and frames

    def open_session(self, name: str = "", link: str = LOCAL) -> Session:
        return Session(name, link)

    def close_session(self, session: Session) -> None:
        """A connection went away: free every stream it held."""
        with self._lock:
            for handle in list(session.handles):
                self.streams.remove(self.streams.by_handle[handle])

    def run_prefetch(self, stop: Callable[[], bool] | None = None) -> None:
        """Idle-time work for a serving loop that drives prefetch itself; ``stop`` says when
        the host's next request is waiting (the work that can wait then stops)."""
        if self.prefetcher is not None:
            self.prefetcher.run_pending(stop)

    def shutdown(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = self.stream_service.prefetcher = None

    def handle(self, session: Session, frame: bytes) -> bytes | None:
        """Serve one frame; the reply frame, or None if the frame is dropped."""
        reply = self._serve_frame(session, frame)
        assert not isinstance(reply, _Waiting)  # drafts are deferred inside handle_many only
        return reply

    def _serve_frame(self, session: Session, frame: bytes) -> bytes | _Waiting | None:
        """Serve one frame: its reply frame, None when it is dropped, or (inside
        ``handle_many``) a COMMIT waiting for its draft."""
        n = len(frame)
        t = self.telemetry
        if n < FRAME_OVERHEAD or n > FRAME_OVERHEAD + MAX_PAYLOAD:
            t.frames_dropped += 1
            return None
        version, op, rid, handle, length = HEADER.unpack_from(frame)
        if (
            n != FRAME_OVERHEAD + length
            or crc32(memoryview(frame)[: n - CRC_SIZE]) != CRC.unpack_from(frame, n - CRC_SIZE)[0]
        ):
            t.frames_dropped += 1
            return None
        with self._lock:
            t.frames += 1
            try:
                if version != PROTOCOL_VERSION:
                    raise ProtocolError(
                        f"frame version {version} is not spoken here; this card speaks "
                        f"v{PROTOCOL_VERSION}",
                        ErrorCode.UNSUPPORTED_VERSION,
                    )
                handler = self._handlers.get(op)
                if handler is None:
                    raise ProtocolError(
                        "this card has no image store; start the emulator with --store DIR"
                        if op in STORE_OPCODES
                        else f"unknown opcode 0x{op:02x}",
                        ErrorCode.UNKNOWN_OPCODE,
                    )
                if session.version is None and op in _NEEDS_HANDSHAKE:
                    raise ProtocolError(
                        "send HELLO before using streams", ErrorCode.HANDSHAKE_REQUIRED
                    )
                if session.link != LOCAL and not session.admin and op in _GUARDED[session.link]:
                    t.admin_refused += 1
                    raise NotAuthorizedError(self._refusal(op, session))
                payload = handler(session, handle, frame[HEADER_SIZE : n - CRC_SIZE])
            except ExstillError as exc:
                return self._error(rid, handle, exc.code, exc.message)
            except Exception as exc:  # a runtime bug must not take the card down
                log.exception("internal error serving opcode 0x%02x", op)
                return self._error(rid, handle, ErrorCode.INTERNAL, f"internal error: {exc}")
            if isinstance(payload, Deferred):
                return _Waiting(payload, rid, handle)
            return pack_frame(op | RESPONSE_BIT, rid, handle, payload)

    def handle_many(self, session: Session, frames: Iterable[bytes]) -> list[bytes]:
        """Serve the frames of one read in order; their replies (a dropped frame has none).
        The COMMITs among them whose draft ahead missed are drafted together, one batched
        step per position for all their streams, instead of one stream after another: a host
        that sends a batch's rounds at once waits for one draft, not one per stream."""
        out: list[bytes | _Waiting | None] = []
        waiting: set[int] = set()  # handles with a deferred draft
        self._batching = True
        try:
            for frame in frames:
                if waiting and not self._joins_batch(frame, waiting):
                    self._draft_deferred(out)
                    waiting.clear()
                reply = self._serve_frame(session, frame)
                if isinstance(reply, _Waiting):
                    waiting.add(reply.handle)
                out.append(reply)
        finally:
            self._batching = False
        if waiting:
            self._draft_deferred(out)
        return [r for r in out if isinstance(r, bytes)]

    @staticmethod
    def _joins_batch(frame: bytes, waiting: set[int]) -> bool:
        """A COMMIT for a stream with no deferred draft: it may be served before them."""
        if len(frame) < HEADER_SIZE or frame[1] != Opcode.COMMIT:
            return False
        return HEADER.unpack_from(frame)[3] not in waiting

    def _commit(self, session: Session, handle: int, payload: bytes) -> bytes | Deferred:
        return self.stream_service.commit(session, handle, payload, defer=self._batching)

    def _draft_deferred(self, out: list[bytes | _Waiting | None]) -> None:
        """Make every deferred draft in ``out`` (stream_service.draft_deferred) and put the
        sealed replies in their places."""
        places = [(i, w) for i, w in enumerate(out) if isinstance(w, _Waiting)]
        with self._lock:
            payloads = self.stream_service.draft_deferred([w.commit for _, w in places])
        for (i, w), payload in zip(places, payloads, strict=True):
            if isinstance(payload, bytes):
                out[i] = pack_frame(Opcode.COMMIT | RESPONSE_BIT, w.rid, w.handle, payload)
            elif isinstance(payload, ExstillError):
                out[i] = self._error(w.rid, w.handle, payload.code, payload.message)
            else:  # a runtime bug must not take the card down
                log.error("internal error drafting a batch of rounds", exc_info=payload)
                out[i] = self._error(
                    w.rid, w.handle, ErrorCode.INTERNAL, f"internal error: {payload}"
                )

    def _refusal(self, op: int, session: Session) -> str:
        what = "administration" if op in ADMIN_OPCODES else "a request from another host"
        if self.admin_key is None:
            return (
                f"this card takes no {what} over the network: it has no admin key (start the "
                "emulator with --admin-key FILE)"
            )
        return f"{what} needs the card's admin key: pass it (exstill-flash --key FILE)"

    def _auth_challenge(self, session: Session, handle: int, payload: bytes) -> bytes:
        if payload:
            raise ProtocolError("AUTH_CHALLENGE takes no payload")
        session.nonce = os.urandom(AUTH_NONCE_SIZE)
        return session.nonce

    def _auth(self, session: Session, handle: int, payload: bytes) -> bytes:
        """Check the answer to this session's challenge: HMAC-SHA256 under the admin key of
        AUTH_CONTEXT + nonce. The nonce is used once, right or wrong, so a recorded answer
        proves nothing on another connection or a second time."""
        nonce, session.nonce = session.nonce, None
        if len(payload) != AUTH_NONCE_SIZE:
            raise ProtocolError(f"AUTH carries {AUTH_NONCE_SIZE} bytes, not {len(payload)}")
        if nonce is None or self.admin_key is None:
            self.telemetry.admin_refused += 1
            raise NotAuthorizedError(
                "no admin key on this card"
                if self.admin_key is None
                else "ask AUTH_CHALLENGE first"
            )
        if not hmac.compare_digest(answer(self.admin_key, nonce), payload):
            self.telemetry.admin_refused += 1
            raise NotAuthorizedError("wrong admin key: this card was started with another one")
        session.admin = True
        return b""

    def refusal(self, frame: bytes, code: int, message: str) -> bytes:
        """An ERROR reply to ``frame`` (its request id echoed) without serving it: how a
        server turns away a request it will not hand to the runtime."""
        rid = frame[2] | frame[3] << 8 if len(frame) >= 4 else 0
        return self._error(rid, 0, code, message)

    def _error(self, rid: int, handle: int, code: int, message: str) -> bytes:
        if code in self.telemetry.errors:
            self.telemetry.errors[code] += 1
        return pack_frame(
            Opcode.ERROR, rid, handle, m.encode_error_reply(m.ErrorReply(code, message))
        )

    # ------------------------------------------------------------ control

    def _hello(self, session: Session, handle: int, payload: bytes) -> bytes:
        req = m.decode_hello_request(payload)
        if not req.min_version <= PROTOCOL_VERSION <= req.max_version:
            raise ProtocolError(
                f"client speaks v{req.min_version}..v{req.max_version}, this card speaks "
                f"v{PROTOCOL_VERSION}; update the SDK or the firmware",
                ErrorCode.UNSUPPORTED_VERSION,
            )
        session.version = PROTOCOL_VERSION
        session.name = req.client
        engines = [e.name for e in self.models.values() if e.kind == ModelKind.ENGINE]
        targets = [
            m.TargetInfo(e.name, e.vocab_size, e.tokenizer_sha256)
            for e in self.models.values()
            if e.kind == ModelKind.TARGET
        ]
        features = Features.PIPELINING | Features.TREES | Features.SAMPLED_TREES
        if self.prefetcher:
            features |= Features.PREFETCH
            if self.prefetcher.outcomes:
                features |= Features.OUTCOMES
        if self.store is not None:
            features |= Features.IMAGE_STORE
        return m.encode_hello_reply(
            m.HelloReply(
                version=PROTOCOL_VERSION,
                firmware=f"exstill-emu {__version__}",
                slots=len(self.streams.slots),
                context=self.context,
                max_k=self.max_k,
                wire_modes=(1 << WireMode.TOKENS) | (1 << WireMode.DIST),
                features=int(features),
                max_payload=MAX_PAYLOAD,
                engines=tuple(engines),
                targets=tuple(targets),
            )
        )

    def _ping(self, session: Session, handle: int, payload: bytes) -> bytes:
        return payload

    def stats(self) -> dict[str, int]:
        """The telemetry counters STATS reports (and exstill-emu's metrics endpoint)."""
        return self.telemetry.snapshot(self.streams.open_count)

    def _stats(self, session: Session, handle: int, payload: bytes) -> bytes:
        if payload:
            raise ProtocolError("STATS takes no payload")
        return m.encode_stats_reply(self.stats())
