"""The stream table: a fixed number of slots, each a context of fixed capacity.

A handle is ``(nonce << 8) | slot`` with a fresh 24-bit random nonce per open, and a stream
belongs to the session (connection) that opened it: a handle from another connection, a closed
stream's handle or a guessed one is refused, never served.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from exstill_sdk.errors import CardFullError, InvalidArgumentError, StreamHandleError

from .engines.base import DraftEngine, EngineState, Sampling

if TYPE_CHECKING:
    from .outcomes import OutcomeSet

MAX_SLOTS = 255


class PrefetchResult(NamedTuple):
    version: int
    """The stream version the branch was drafted from."""
    branch: bytes
    """The guessed committed tokens (draft + bonus guess, u32 LE) it drafted after."""
    tokens: bytes
    """Up to k+1 drafted tokens after the branch (the last one is the next guess)."""
    dists: tuple | None
    lookup: bool = False
    """Proposal.lookup."""
    logits: np.ndarray | None = None
    """Proposal.logits."""


LOCAL, NETWORK, REMOTE = "local", "network", "remote"
"""Who may be at the other end of a link. LOCAL: USB, serial, in process; the operating
system's permissions decide who opens the device. NETWORK: a loopback TCP connection;
administration needs the admin key. REMOTE: TCP from another host; every request but HELLO,
PING and the AUTH exchange needs the admin key."""


class Session:
    """One client connection's view of the card."""

    __slots__ = ("admin", "handles", "link", "name", "nonce", "version")

    def __init__(self, name: str = "", link: str = LOCAL) -> None:
        self.name = name
        self.link = link
        self.version: int | None = None
        """Negotiated protocol version; None until HELLO."""
        self.handles: set[int] = set()
        self.admin = False
        """The session proved the card's admin key (AUTH)."""
        self.nonce: bytes | None = None
        """The challenge the card sent and has not seen answered yet (used once)."""


class Stream:
    __slots__ = (
        "capacity",
        "closed",
        "dist",
        "engine",
        "handle",
        "logits",
        "max_k",
        "outcomes",
        "outcomes_scheduled",
        "pending",
        "pending_parents",
        "prefetch",
        "prefetch_scheduled",
        "replied_at",
        "sampling",
        "session",
        "slot",
        "state",
        "version",
        "window",
    )

    def __init__(
        self,
        slot: int,
        handle: int,
        session: Session,
        engine: DraftEngine,
        state: EngineState,
        sampling: Sampling,
        capacity: int,
        max_k: int,
        dist: bool,
    ) -> None:
        self.slot = slot
        self.handle = handle
        self.session = session
        self.engine = engine
        self.state = state
        self.sampling = sampling
        self.capacity = capacity
        self.max_k = max_k
        self.dist = dist
        self.closed = False
        self.pending = b""
        """The last draft's tokens (u32 LE), which a COMMIT accepts a prefix of."""
        self.pending_parents: bytes | None = None
        """The last draft's parents (u8 each) when it was a tree (COMMIT_TREE names a path of
        it); None for a chain."""
        self.logits: np.ndarray | None = None
        """The logits the pending chain draft and its guess were chosen from, when kept
        (EngineState.keep_logits): what the card ranks other outcomes by."""
        self.prefetch: PrefetchResult | None = None
        self.prefetch_scheduled = False
        self.outcomes: OutcomeSet | None = None
        """Drafts made ahead for outcomes other than the full-acceptance one."""
        self.outcomes_scheduled = False
        self.replied_at = 0.0
        """perf_counter() when the card last replied with a draft."""
        self.window = 0.0
        """Seconds the host takes from a draft reply to its COMMIT (moving average; 0:
        not seen yet): the time the card may spend drafting ahead."""
        self.version = 0
        """Sequence counter: odd while the context is being changed, bumped by 2 per change.
        The prefetch worker keeps a result only if the version was even and unchanged
        around its work."""

    @property
    def length(self) -> int:
        return self.state.length

    def begin_change(self) -> None:
        self.version += 1
        self.prefetch = None
        self.prefetch_scheduled = False
        self.outcomes = None
        self.outcomes_scheduled = False

    def end_change(self) -> None:
        self.version += 1


class StreamTable:
    def __init__(self, slots: int) -> None:
        if not 1 <= slots <= MAX_SLOTS:
            raise InvalidArgumentError(f"a card has 1..{MAX_SLOTS} stream slots, not {slots}")
        self.slots: list[Stream | None] = [None] * slots
        self.by_handle: dict[int, Stream] = {}

    @property
    def open_count(self) -> int:
        return len(self.by_handle)

    def free_slot(self) -> int:
        for i, s in enumerate(self.slots):
            if s is None:
                return i
        raise CardFullError(
            f"all {len(self.slots)} stream slots are in use; close a finished stream "
            "or retry when one frees"
        )

    @staticmethod
    def new_handle(slot: int) -> int:
        return ((secrets.randbits(24) or 1) << 8) | slot

    def add(self, stream: Stream) -> None:
        self.slots[stream.slot] = stream
        self.by_handle[stream.handle] = stream
        stream.session.handles.add(stream.handle)

    def get(self, session: Session, handle: int) -> Stream:
        stream = self.by_handle.get(handle)
        if stream is None or stream.session is not session:
            raise StreamHandleError(
                f"stream handle 0x{handle:08x} is not open on this connection; "
                "open a stream first (handles are not shared between connections)"
            )
        return stream

    def remove(self, stream: Stream) -> None:
        stream.closed = True
        stream.prefetch, stream.outcomes, stream.logits = None, None, None
        stream.state.close()
        self.slots[stream.slot] = None
        del self.by_handle[stream.handle]
        stream.session.handles.discard(stream.handle)
