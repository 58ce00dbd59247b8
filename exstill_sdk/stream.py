"""A stream on the card: one sequence's drafting state, and the round (COMMIT) that moves it.

One round of speculative decoding is one ``DraftStream.commit``: one frame out, one frame back;
``send_commit`` and ``receive_commit`` split it so that several streams' rounds travel together.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from types import TracebackType
from typing import Protocol

from exstill_sdk.errors import (
    DeviceLostError,
    ExstillError,
    InvalidArgumentError,
    LinkTimeoutError,
    ProtocolError,
)
from exstill_sdk.protocol import messages as m
from exstill_sdk.protocol.constants import CRC_SIZE, HEADER_SIZE, Opcode
from exstill_sdk.protocol.drafts import NO_DRAFT, Draft, Verdict
from exstill_sdk.protocol.frame import pack_frame


class RequestPath(Protocol):
    """How a stream reaches its card: request ids, frames out, checked replies back. ``Card``
    is one; a pool of cards gives each stream the path of the card it lives on."""

    timeout: float

    @property
    def closed(self) -> bool: ...

    @property
    def max_payload(self) -> int: ...

    def check_open(self) -> None: ...

    def next_rid(self) -> int: ...

    def forget(self, rid: int) -> None: ...

    def send(self, frame: bytes, rid: int) -> None: ...

    def receive(self, rid: int, opcode: int, deadline: float) -> bytes: ...

    def exchange(self, frame: bytes, rid: int, opcode: int, timeout: float | None) -> bytes: ...

    def request(
        self, opcode: Opcode, payload: bytes = b"", handle: int = 0, timeout: float | None = None
    ) -> bytes: ...


class DraftStream:
    """One sequence's drafting state on the card: a slot holding its committed context.

    The host mirrors the committed length. If a request times out its effect on the card is
    unknown, so the stream resynchronises (a rollback to the host's length) before the next
    request.
    """

    def __init__(
        self, card: RequestPath, handle: int, capacity: int, max_k: int, model: str
    ) -> None:
        self.card = card
        self.handle = handle
        self.capacity = capacity
        self.max_k = max_k
        self.model = model
        self.length = 0
        self.last_draft = NO_DRAFT
        """The draft a COMMIT judges (none after a prefill or a rollback)."""
        self._resync = False
        self._tree_commits: set[int] = set()
        """Request ids of COMMIT_TREE frames sent, whose replies are trees."""
        self.closed = False
        self.lost = False
        """Closed because its card was lost (reset, unplugged, set aside by a pool)."""

    def mark_lost(self) -> None:
        """The card lost this stream (it reset or went away): closed, and its requests raise
        DeviceLostError, so that whoever holds it recovers as from a lost card."""
        self.closed = self.lost = True

    def _guard(self) -> None:
        if self.closed:
            if self.lost:
                raise DeviceLostError("this stream's card was lost; open a new stream")
            raise ExstillError("this stream is closed; open a new one")
        if self._resync:
            self._do_rollback(self.length)
            self._resync = False

    def _exchange(self, frame: bytes, rid: int, opcode: int, timeout: float | None) -> bytes:
        """The card's reply frame; a timeout leaves the card's state unknown, so the stream
        resynchronises before its next request."""
        try:
            return self.card.exchange(frame, rid, opcode, timeout)
        except LinkTimeoutError:
            self._resync = True
            raise

    def _request(self, opcode: Opcode, payload: bytes, timeout: float | None) -> bytes:
        """A non-round request on this stream; the reply payload. Timeouts as in _exchange."""
        try:
            return self.card.request(opcode, payload, self.handle, timeout)
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
        chunk = self.card.max_payload // 4
        for start in range(0, len(tokens), chunk):
            part = m.encode_tokens(tokens[start : start + chunk])
            self.length = m.decode_u32(self._request(Opcode.PREFILL, part, timeout))
        self.last_draft = NO_DRAFT
        return self.length

    def send_prefill(self, tokens: list[int] | tuple[int, ...]) -> int:
        """Append tokens without waiting for the card (one frame's worth at most): the card
        takes them in while the host works on. ``receive_prefill`` with the returned request
        id completes it; requests sent on the stream meanwhile are served after it, in order."""
        self._guard()
        if len(tokens) > self.card.max_payload // 4:
            raise InvalidArgumentError(
                f"{len(tokens)} tokens do not fit one frame; use prefill() for long runs"
            )
        card = self.card
        card.check_open()
        rid = card.next_rid()
        frame = pack_frame(Opcode.PREFILL, rid, self.handle, m.encode_tokens(tokens))
        try:
            card.send(frame, rid)
        except LinkTimeoutError:
            self._resync = True
            raise
        return rid

    def receive_prefill(self, rid: int, timeout: float | None = None) -> int:
        """The second half of ``send_prefill``: the stream's new length."""
        deadline = time.monotonic() + (timeout or self.card.timeout)
        try:
            reply = self.card.receive(rid, Opcode.PREFILL, deadline)
        except LinkTimeoutError:
            self._resync = True
            raise
        self.length = m.decode_u32(reply[HEADER_SIZE:-CRC_SIZE])
        self.last_draft = NO_DRAFT
        return self.length

    def draft(self, k: int, timeout: float | None = None) -> Draft:
        """Propose up to ``k`` tokens after the committed context."""
        reply = self._ask_draft(
            lambda rid: m.draft_frame(rid, self.handle, k), Opcode.DRAFT, timeout, "K", k
        )
        self.last_draft = m.parse_draft_reply_frame(reply)
        return self.last_draft

    def draft_tree(self, shape: m.TreeRequest, timeout: float | None = None) -> Draft:
        """Propose a token tree of ``shape`` after the committed context (a card with
        Features.TREES); a chain-shaped answer comes as a chain (``Draft.parents`` None). A
        sampled stream's tree needs DIST wire mode (Features.SAMPLED_TREES): its children were
        drawn, and ``Draft.dists`` holds what each node was drawn from."""
        reply = self._ask_draft(
            lambda rid: m.draft_tree_frame(rid, self.handle, shape),
            Opcode.DRAFT_TREE,
            timeout,
            "each of a tree's nodes, top-k and depth",
            shape,
        )
        self.last_draft = m.parse_tree_reply_frame(reply)
        return self.last_draft

    def _ask_draft(
        self,
        build: Callable[[int], bytes],
        opcode: Opcode,
        timeout: float | None,
        what: str,
        value: object,
    ) -> bytes:
        """The reply frame to a draft request that ``build`` makes for a request id; a field
        out of range (``what``, given as ``value``) is refused before anything is sent."""
        self._guard()
        card = self.card
        card.check_open()
        rid = card.next_rid()
        try:
            frame = build(rid)
        except struct.error:
            card.forget(rid)
            raise InvalidArgumentError(f"{what} must be 0..255, not {value!r}") from None
        return self._exchange(frame, rid, opcode, timeout)

    def commit(
        self, verdict: Verdict, next_k: int | m.TreeRequest, timeout: float | None = None
    ) -> Draft:
        """One verification round: the target's ``verdict`` on the last draft (what it
        accepted, and its own token after that); returns the next draft of up to ``next_k``
        tokens, or a tree of that shape. A tree draft's verdict names its path; such a round
        (or one asking for a tree) travels as COMMIT_TREE."""
        deadline = time.monotonic() + (timeout or self.card.timeout)  # counted from the send
        return self._commit_reply(self.send_commit(verdict, next_k), verdict, deadline)

    def send_commit(self, verdict: Verdict, next_k: int | m.TreeRequest) -> int:
        """The first half of ``commit``: send the round without waiting for the reply, so that
        several streams' rounds travel together; ``receive_commit`` with the returned request
        id (and the same verdict) completes it."""
        if self._resync or self.closed:
            self._guard()
        self.last_draft.check(verdict)
        card = self.card
        if card.closed:
            card.check_open()
        rid = card.next_rid()
        try:
            if isinstance(next_k, int) and self.last_draft.parents is None:
                frame = m.commit_frame(rid, self.handle, verdict, next_k)
            else:
                shape = next_k if isinstance(next_k, m.TreeRequest) else m.TreeRequest(next_k, 1)
                frame = m.commit_tree_frame(rid, self.handle, verdict, shape)
                self._tree_commits.add(rid)
        except (struct.error, ProtocolError):
            card.forget(rid)
            raise InvalidArgumentError(
                f"the token must be a u32 id and next K 0..255 (got {verdict.token!r}, {next_k!r})"
            ) from None
        try:
            card.send(frame, rid)
        except LinkTimeoutError:  # the card may have the round: resynchronise before the next
            self._resync = True
            raise
        return rid

    def receive_commit(self, rid: int, verdict: Verdict, timeout: float | None = None) -> Draft:
        """The second half of ``commit``: the next draft. A timeout leaves the card's state
        unknown, so the stream resynchronises before its next request."""
        deadline = time.monotonic() + (timeout or self.card.timeout)
        return self._commit_reply(rid, verdict, deadline)

    def _commit_reply(self, rid: int, verdict: Verdict, deadline: float) -> Draft:
        tree = rid in self._tree_commits
        if tree:
            self._tree_commits.discard(rid)
        try:
            reply = self.card.receive(rid, Opcode.COMMIT_TREE if tree else Opcode.COMMIT, deadline)
        except LinkTimeoutError:
            self._resync = True
            raise
        result = m.parse_tree_reply_frame(reply) if tree else m.parse_draft_reply_frame(reply)
        self.length += verdict.accepted + 1  # what any draft's verdict keeps: its own token too
        self.last_draft = result
        return result

    def _do_rollback(self, length: int, timeout: float | None = None) -> int:
        self.length = m.decode_u32(self._request(Opcode.ROLLBACK, m.encode_u32(length), timeout))
        self.last_draft = NO_DRAFT
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
        if not self.card.closed:
            self.card.request(Opcode.CLOSE, b"", self.handle)

    def __enter__(self) -> DraftStream:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
