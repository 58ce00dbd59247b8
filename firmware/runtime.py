"""The card runtime: frames in, frames out, for any number of client sessions.

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
from zlib import crc32

import numpy as np

from exstill_sdk.auth import answer
from exstill_sdk.errors import (
    ContextFullError,
    ExstillError,
    InvalidArgumentError,
    NotAuthorizedError,
    ProtocolError,
    UnknownModelError,
)
from exstill_sdk.protocol import messages as m
from exstill_sdk.protocol.constants import (
    ADMIN_OPCODES,
    AUTH_NONCE_SIZE,
    CRC_SIZE,
    FRAME_OVERHEAD,
    HEADER_SIZE,
    MAX_DIST_ENTRIES,
    MAX_PAYLOAD,
    PROTOCOL_VERSION,
    RESPONSE_BIT,
    STORE_OPCODES,
    ErrorCode,
    Features,
    ModelKind,
    Opcode,
    OpenFlags,
    WireMode,
)
from exstill_sdk.protocol.frame import CRC, HEADER, seal

from .engines import DraftEngine, LookupEngine, Sampling
from .engines.hybrid import HybridEngine
from .flashing import StoreService, transformer_factory
from .prefetch import Prefetcher
from .store import Store
from .streams import LOCAL, NETWORK, REMOTE, Session, Stream, StreamTable
from .telemetry import Telemetry
from .version import __version__

log = logging.getLogger(__name__)

DEFAULT_SLOTS = 12
DEFAULT_CONTEXT = 16384
DEFAULT_MAX_K = 16
MAX_K_LIMIT = 64

Handler = Callable[[Session, int, bytes], bytes]
_GUARDED = {
    NETWORK: ADMIN_OPCODES,
    REMOTE: frozenset(Opcode) - {Opcode.HELLO, Opcode.PING, Opcode.AUTH_CHALLENGE, Opcode.AUTH},
}
"""Per link kind, the requests that need an authenticated session."""
_NEEDS_HANDSHAKE = frozenset(
    {Opcode.OPEN, Opcode.CLOSE, Opcode.PREFILL, Opcode.DRAFT, Opcode.COMMIT, Opcode.ROLLBACK}
    | STORE_OPCODES
)
"""Requests a session may make only after its HELLO."""


class _Deferred:
    """A COMMIT whose draft ahead missed, its draft made with the others of the same read
    (``CardRuntime.handle_many``): one batched step per drafted position for all of them."""

    __slots__ = ("handle", "k", "rid", "stream")

    def __init__(self, stream: Stream, k: int) -> None:
        self.stream, self.k = stream, k
        self.rid = self.handle = 0


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
    ) -> None:
        """``prefetch`` drafts ahead between rounds; with ``background_prefetch`` a worker
        thread does it, otherwise the serving loop calls ``run_prefetch`` when idle.
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
        self._hybrids: dict[str, HybridEngine] = {}
        self.telemetry = Telemetry()
        self.prefetcher = Prefetcher(background_prefetch) if prefetch else None
        self._lock = threading.Lock()
        self._batching = False
        """Inside handle_many: COMMITs that need a fresh draft defer it (``_Deferred``)."""
        self._handlers: dict[int, Callable[[Session, int, bytes], bytes]] = {
            Opcode.HELLO: self._hello,
            Opcode.PING: self._ping,
            Opcode.STATS: self._stats,
            Opcode.OPEN: self._open,
            Opcode.CLOSE: self._close,
            Opcode.PREFILL: self._prefill,
            Opcode.DRAFT: self._draft,
            Opcode.COMMIT: self._commit,
            Opcode.ROLLBACK: self._rollback,
        }
        self.admin_key = admin_key
        self._handlers[Opcode.AUTH_CHALLENGE] = self._auth_challenge
        self._handlers[Opcode.AUTH] = self._auth
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

    def run_prefetch(self) -> None:
        """Idle-time work for a serving loop that drives prefetch itself."""
        if self.prefetcher is not None:
            self.prefetcher.run_pending()

    def shutdown(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None

    def handle(self, session: Session, frame: bytes) -> bytes | None:
        """Serve one frame; the reply frame, or None if the frame is dropped."""
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
            if payload.__class__ is _Deferred:
                payload.rid, payload.handle = rid, handle  # type: ignore[attr-defined]
                return payload  # type: ignore[return-value]
            return seal(
                HEADER.pack(PROTOCOL_VERSION, op | RESPONSE_BIT, rid, handle, len(payload))
                + payload
            )

    def handle_many(self, session: Session, frames: Iterable[bytes]) -> list[bytes]:
        """Serve the frames of one read in order; their replies (a dropped frame has none).
        The COMMITs among them whose draft ahead missed are drafted together, one batched
        step per position for all their streams, instead of one stream after another: a host
        that sends a batch's rounds at once waits for one draft, not one per stream."""
        out: list[bytes | _Deferred | None] = []
        waiting: set[int] = set()  # handles with a deferred draft
        self._batching = True
        try:
            for frame in frames:
                if waiting and not self._joins_batch(frame, waiting):
                    self._draft_deferred(out)
                    waiting.clear()
                reply = self.handle(session, frame)
                if reply.__class__ is _Deferred:
                    waiting.add(reply.handle)  # type: ignore[union-attr]
                out.append(reply)
        finally:
            self._batching = False
        if waiting:
            self._draft_deferred(out)
        return [r for r in out if r is not None]  # type: ignore[misc]

    @staticmethod
    def _joins_batch(frame: bytes, waiting: set[int]) -> bool:
        """A COMMIT for a stream with no deferred draft: it may be served before them."""
        if len(frame) < HEADER_SIZE or frame[1] != Opcode.COMMIT:
            return False
        return HEADER.unpack_from(frame)[3] not in waiting

    def _draft_deferred(self, out: list[bytes | _Deferred | None]) -> None:
        """Make every deferred draft in ``out``, batched per engine, and put the replies in
        their places."""
        jobs = [(i, d) for i, d in enumerate(out) if d.__class__ is _Deferred]
        ahead = self.prefetcher is not None  # one more token: the bonus guess
        with self._lock:
            by_engine: dict[int, list[tuple[int, _Deferred]]] = {}
            for i, d in jobs:
                by_engine.setdefault(id(d.stream.engine), []).append((i, d))  # type: ignore[union-attr]
            for group in by_engine.values():
                engine = group[0][1].stream.engine
                try:
                    proposals = engine.propose_many(
                        [(d.stream.state, d.k + ahead, b"") for _, d in group]
                    )
                    for (i, d), proposal in zip(group, proposals, strict=True):
                        payload = self._serve(
                            d.stream, d.k, proposal.tokens, proposal.dists, lookup=proposal.lookup
                        )
                        out[i] = seal(
                            HEADER.pack(
                                PROTOCOL_VERSION,
                                Opcode.COMMIT | RESPONSE_BIT,
                                d.rid,
                                d.handle,
                                len(payload),
                            )
                            + payload
                        )
                except ExstillError as exc:
                    for i, d in group:
                        out[i] = self._error(d.rid, d.handle, exc.code, exc.message)
                except Exception as exc:  # a runtime bug must not take the card down
                    log.exception("internal error drafting a batch of rounds")
                    for i, d in group:
                        out[i] = self._error(
                            d.rid, d.handle, ErrorCode.INTERNAL, f"internal error: {exc}"
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
        payload = m.encode_error_reply(m.ErrorReply(code, message))
        return seal(
            HEADER.pack(PROTOCOL_VERSION, Opcode.ERROR, rid, handle, len(payload)) + payload
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
        features = Features.PIPELINING
        if self.prefetcher:
            features |= Features.PREFETCH
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

    def _stats(self, session: Session, handle: int, payload: bytes) -> bytes:
        if payload:
            raise ProtocolError("STATS takes no payload")
        return m.encode_stats_reply(self.telemetry.snapshot(self.streams.open_count))

    # ------------------------------------------------------------ streams

    def _with_lookup(self, model: DraftEngine) -> DraftEngine:
        """The target's model with prompt lookup in front (OpenFlags.LOOKUP), one per model so
        that its streams draft together."""
        if model.kind != ModelKind.TARGET:
            raise InvalidArgumentError(
                f"{model.name!r} is an engine: LOOKUP is for target streams (open the lookup "
                "engine itself for lookup alone)"
            )
        hybrid = self._hybrids.get(model.name)
        if hybrid is None or hybrid.model is not model:
            hybrid = self._hybrids[model.name] = HybridEngine(model)
        return hybrid

    def _open(self, session: Session, handle: int, payload: bytes) -> bytes:
        req = m.decode_open_request(payload)
        model = self.models.get(req.name)
        if model is None or model.kind != req.kind:
            kind = ModelKind(req.kind).name.lower() if req.kind in (0, 1) else "model"
            raise UnknownModelError(
                f"this card has no {kind} {req.name!r}; it has: "
                + ", ".join(sorted(self.models) or ["nothing"])
            )
        if req.wire_mode not in (WireMode.TOKENS, WireMode.DIST):
            raise InvalidArgumentError(f"unknown wire mode {req.wire_mode}")
        max_k = req.max_k or self.max_k
        if max_k > self.max_k:
            raise InvalidArgumentError(
                f"max K {max_k} exceeds this card's {self.max_k}", ErrorCode.K_OUT_OF_RANGE
            )
        if req.flags & ~(OpenFlags.LONG_CONTEXT | OpenFlags.LOOKUP):
            raise InvalidArgumentError(f"unknown OPEN flags 0x{req.flags:02x}")
        long_context = bool(req.flags & OpenFlags.LONG_CONTEXT)
        if req.flags & OpenFlags.LOOKUP:
            model = self._with_lookup(model)
        dist = req.wire_mode == WireMode.DIST
        sampling = Sampling(  # checks the values as the host's SamplingParams does
            req.temperature, req.top_k, req.top_p, req.seed, MAX_DIST_ENTRIES if dist else 0
        )
        slot = self.streams.free_slot()
        stream = Stream(
            slot=slot,
            handle=self.streams.new_handle(slot),
            session=session,
            engine=model,
            state=model.open_state(self.context, sampling, long_context),
            sampling=sampling,
            capacity=1 << 62 if long_context else self.context,
            max_k=max_k,
            dist=dist,
        )
        self.streams.add(stream)
        self.telemetry.streams_opened += 1
        return m.encode_open_reply(m.OpenReply(stream.handle, self.context, max_k))

    def _close(self, session: Session, handle: int, payload: bytes) -> bytes:
        self.streams.remove(self.streams.get(session, handle))
        return b""

    def _prefill(self, session: Session, handle: int, payload: bytes) -> bytes:
        stream = self.streams.get(session, handle)
        if len(payload) & 3:
            raise ProtocolError(f"prefill of {len(payload)} bytes is not whole u32 tokens")
        self._check_room(stream, len(payload) >> 2)
        vocab = stream.engine.vocab_size
        if vocab and payload and int(np.frombuffer(payload, "<u4").max()) >= vocab:
            raise InvalidArgumentError(
                f"a token id is beyond {stream.engine.name!r}'s vocabulary of {vocab}: "
                "the prompt was tokenized for another model"
            )
        stream.begin_change()
        stream.pending = b""
        stream.state.extend(payload)
        stream.end_change()
        if self.prefetcher is not None:  # take the tokens in while idle: drafting next is quick
            self.prefetcher.submit(stream, b"", b"", 0)
        return m.U32.pack(stream.length)

    def _rollback(self, session: Session, handle: int, payload: bytes) -> bytes:
        stream = self.streams.get(session, handle)
        length = m.decode_u32(payload)
        if length > stream.length:
            raise InvalidArgumentError(
                f"cannot roll back to {length}: the stream holds {stream.length} tokens"
            )
        stream.begin_change()
        stream.pending = b""
        try:
            stream.state.truncate(length)  # may refuse (long context: evicted tokens)
        finally:
            stream.end_change()
        return m.U32.pack(length)

    def _draft(self, session: Session, handle: int, payload: bytes) -> bytes:
        stream = self.streams.get(session, handle)
        k = m.decode_u8(payload)
        self._check_k(stream, k)
        stream.begin_change()  # a new draft replaces the pending one and voids its prefetch
        stream.end_change()
        return self._draft_reply(stream, k)

    def _commit(self, session: Session, handle: int, payload: bytes) -> bytes:
        # The per-round path: checks are inlined, and nothing changes before they all pass.
        stream = self.streams.by_handle.get(handle)
        if stream is None or stream.session is not session:
            stream = self.streams.get(session, handle)  # raises the typed error
        if len(payload) != 6:
            raise ProtocolError(f"COMMIT payload must be 6 bytes, got {len(payload)}")
        accepted, next_k, bonus = m.COMMIT_REQUEST.unpack(payload)
        vocab = stream.engine.vocab_size
        if vocab and bonus >= vocab:
            raise InvalidArgumentError(
                f"token {bonus} is beyond {stream.engine.name!r}'s vocabulary of {vocab}"
            )
        pending = stream.pending
        if accepted << 2 > len(pending):
            raise InvalidArgumentError(
                f"accepted {accepted} tokens but the last draft had {len(pending) >> 2}"
            )
        if next_k > stream.max_k:
            self._check_k(stream, next_k)
        state = stream.state
        if state.length + accepted + 1 > stream.capacity:
            self._check_room(stream, accepted + 1)
        t = self.telemetry
        t.rounds += 1
        t.accepted_tokens += accepted
        committed = pending[: accepted << 2] + payload[2:6]
        pf = stream.prefetch
        hit = (
            pf
            if pf is not None
            and pf.version == stream.version
            and pf.branch == committed
            and len(pf.tokens) >= next_k << 2
            else None
        )
        if stream.prefetch_scheduled:
            if hit is not None:
                t.prefetch_hits += 1
            elif pf is None or pf.version != stream.version:
                t.prefetch_late += 1
            else:
                t.prefetch_misses += 1
        stream.begin_change()
        state.extend(committed, hit.prepared if hit is not None else None)
        stream.end_change()
        if hit is not None:
            return self._serve(
                stream, next_k, hit.tokens, hit.dists, prefetch_hit=True, lookup=hit.lookup
            )
        if self._batching and next_k:
            return _Deferred(stream, next_k)  # type: ignore[return-value]
        return self._draft_reply(stream, next_k)

    # ------------------------------------------------------------ drafting

    def _check_k(self, stream: Stream, k: int) -> None:
        if k > stream.max_k:
            raise InvalidArgumentError(
                f"K {k} exceeds the stream's max K {stream.max_k}", ErrorCode.K_OUT_OF_RANGE
            )

    def _check_room(self, stream: Stream, extra: int) -> None:
        if stream.length + extra > stream.capacity:
            raise ContextFullError(
                f"{extra} more tokens would take the stream past its {stream.capacity}-token "
                f"slot (it holds {stream.length}); roll back or open a new stream"
            )

    def _draft_reply(self, stream: Stream, k: int) -> bytes:
        ask = k + 1 if self.prefetcher is not None and k else k
        proposal = stream.state.propose(ask) if k else None
        if proposal is None:
            return self._serve(stream, 0, b"", None)
        return self._serve(stream, k, proposal.tokens, proposal.dists, lookup=proposal.lookup)

    def _serve(
        self,
        stream: Stream,
        k: int,
        tokens: bytes,
        dists: tuple | None,
        prefetch_hit: bool = False,
        lookup: bool = False,
    ) -> bytes:
        """Reply with the first k of ``tokens``; a (k+1)-th token is the bonus guess that the
        next prefetch drafts after."""
        draft = tokens[: k << 2]
        guess = tokens[k << 2 : (k << 2) + 4]
        count = len(draft) >> 2
        stream.pending = draft
        t = self.telemetry
        if count:
            t.drafts += 1
            t.draft_tokens += count
        if guess and count == k and self.prefetcher is not None:
            self.prefetcher.submit(stream, draft, guess, k)
        lookup = lookup and count > 0
        if not stream.dist:
            return m.draft_reply_payload(prefetch_hit, draft, None, lookup)
        if dists is None:  # deterministic draft: each position is one-hot
            dists = tuple(m.Distribution((tok,), (1,)) for tok in m.TOKENS[count].unpack(draft))
        return m.draft_reply_payload(prefetch_hit, draft, dists[:count], lookup)
