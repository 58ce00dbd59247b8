"""Payloads of every v1 message, encoded and decoded with precompiled ``struct``.

This is the implementation both sides run; ``schema.py`` is the formal ``construct`` definition
of the same bytes, and tests/protocol/test_schema_agreement.py shows the two agree. Every
``decode_*`` raises :class:`~exstill_sdk.errors.ProtocolError` and nothing else for bad bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from exstill_sdk.errors import ProtocolError
from exstill_sdk.protocol.constants import (
    CRC_SIZE,
    FRAME_OVERHEAD,
    HEADER_SIZE,
    MAX_DIST_ENTRIES,
    MAX_ERROR_MESSAGE,
    MAX_NAME,
    MAX_TREE_NODES,
    PROTOCOL_VERSION,
    TREE_ROOT,
    DraftFlags,
    ErrorCode,
    Opcode,
)
from exstill_sdk.protocol.drafts import (
    Distribution,
    Draft,
    Verdict,
    chain_links,
    chain_or_tree,
    path_ok,
)
from exstill_sdk.protocol.frame import pack_frame, seal

U8 = struct.Struct("<B")
U16 = struct.Struct("<H")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
TOKENS = [struct.Struct(f"<{n}I") for n in range(256)]
"""TOKENS[n] packs n token ids; drafts have at most 255 tokens."""
WEIGHTS = [struct.Struct(f"<{n}H") for n in range(256)]

HELLO_REQUEST = struct.Struct("<BB")
HELLO_REPLY_FIXED = struct.Struct(
    "<HIBBII"
)  # slots, context, max_k, wire_modes, features, max_payload
OPEN_REQUEST = struct.Struct("<BBBBHffQ")  # kind, wire_mode, max_k, flags, top_k, temp, top_p, seed
OPEN_REPLY = struct.Struct("<IIB")  # handle, context, max_k
COMMIT_REQUEST = struct.Struct("<BBI")  # accepted, next_k, bonus
DRAFT_REPLY_HEAD = struct.Struct("<BB")  # flags, count
TARGET_FIXED = struct.Struct("<I32s")  # vocab_size, tokenizer_sha256
COUNTER_VALUE = U64
_KNOWN_DRAFT_FLAGS = int(DraftFlags.PREFETCH_HIT | DraftFlags.HAS_DIST | DraftFlags.LOOKUP)
_PLAIN_DRAFT_FLAGS = int(DraftFlags.PREFETCH_HIT | DraftFlags.LOOKUP)
"""Flags of a draft the host reads straight from the frame (no distributions)."""
_HIT, _LOOKUP = int(DraftFlags.PREFETCH_HIT), int(DraftFlags.LOOKUP)
_DIST = int(DraftFlags.HAS_DIST)


def _bad(what: str) -> ProtocolError:
    return ProtocolError(what, ErrorCode.BAD_PAYLOAD)


class _Reader:
    """Bounds-checked cursor over a payload."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, s: struct.Struct) -> tuple:
        try:
            values = s.unpack_from(self.data, self.pos)
        except struct.error:
            raise _bad(f"payload ends inside a field at byte {self.pos}") from None
        self.pos += s.size
        return values

    def str8(self) -> str:
        (n,) = self.take(U8)
        raw = self.data[self.pos : self.pos + n]
        if len(raw) != n:
            raise _bad("payload ends inside a string")
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _bad("string is not UTF-8") from None

    def rest(self) -> bytes:
        out = self.data[self.pos :]
        self.pos = len(self.data)
        return out

    def end(self) -> None:
        if self.pos != len(self.data):
            raise _bad(f"{len(self.data) - self.pos} unexpected bytes after the message")


def _str8(text: str, limit: int = MAX_NAME) -> bytes:
    raw = text.encode("utf-8")
    if len(raw) > limit:
        raise _bad(f"name {text[:20]!r}... is longer than {limit} bytes")
    return U8.pack(len(raw)) + raw


# ---------------------------------------------------------------- HELLO


@dataclass(frozen=True)
class HelloRequest:
    min_version: int
    max_version: int
    client: str = ""


def encode_hello_request(m: HelloRequest) -> bytes:
    return HELLO_REQUEST.pack(m.min_version, m.max_version) + _str8(m.client)


def decode_hello_request(data: bytes) -> HelloRequest:
    r = _Reader(data)
    lo, hi = r.take(HELLO_REQUEST)
    client = r.str8()
    r.end()
    return HelloRequest(lo, hi, client)


@dataclass(frozen=True)
class TargetInfo:
    name: str
    vocab_size: int
    tokenizer_sha256: bytes = bytes(32)


@dataclass(frozen=True)
class HelloReply:
    version: int
    firmware: str
    slots: int
    context: int
    max_k: int
    wire_modes: int
    features: int
    max_payload: int
    engines: tuple[str, ...] = ()
    targets: tuple[TargetInfo, ...] = ()


def encode_hello_reply(m: HelloReply) -> bytes:
    parts = [
        U8.pack(m.version),
        _str8(m.firmware),
        HELLO_REPLY_FIXED.pack(
            m.slots, m.context, m.max_k, m.wire_modes, m.features, m.max_payload
        ),
        U8.pack(len(m.engines)),
    ]
    parts += [_str8(e) for e in m.engines]
    parts.append(U8.pack(len(m.targets)))
    for t in m.targets:
        parts += [_str8(t.name), TARGET_FIXED.pack(t.vocab_size, t.tokenizer_sha256)]
    return b"".join(parts)


def decode_hello_reply(data: bytes) -> HelloReply:
    r = _Reader(data)
    (version,) = r.take(U8)
    firmware = r.str8()
    slots, context, max_k, wire_modes, features, max_payload = r.take(HELLO_REPLY_FIXED)
    (n_engines,) = r.take(U8)
    engines = tuple(r.str8() for _ in range(n_engines))
    (n_targets,) = r.take(U8)
    targets = []
    for _ in range(n_targets):
        name = r.str8()
        vocab, sha = r.take(TARGET_FIXED)
        targets.append(TargetInfo(name, vocab, sha))
    r.end()
    return HelloReply(
        version,
        firmware,
        slots,
        context,
        max_k,
        wire_modes,
        features,
        max_payload,
        engines=engines,
        targets=tuple(targets),
    )


# ---------------------------------------------------------------- STATS


def encode_stats_reply(counters: dict[str, int]) -> bytes:
    parts = [U16.pack(len(counters))]
    for name, value in counters.items():
        parts += [_str8(name), COUNTER_VALUE.pack(value)]
    return b"".join(parts)


def decode_stats_reply(data: bytes) -> dict[str, int]:
    r = _Reader(data)
    (n,) = r.take(U16)
    out = {}
    for _ in range(n):
        name = r.str8()
        (out[name],) = r.take(COUNTER_VALUE)
    r.end()
    return out


# ---------------------------------------------------------------- OPEN


@dataclass(frozen=True)
class OpenRequest:
    kind: int
    name: str
    wire_mode: int = 0
    max_k: int = 0
    """0 asks for the card's maximum."""
    top_k: int = 0
    """0 means no top-k truncation."""
    flags: int = 0
    """OpenFlags: LONG_CONTEXT keeps drafting past the slot (attention sinks + window); LOOKUP
    drafts by prompt lookup where the text repeats, by the model elsewhere."""
    temperature: float = 0.0
    """0 means greedy (argmax) drafting."""
    top_p: float = 1.0
    seed: int = 0


def encode_open_request(m: OpenRequest) -> bytes:
    try:
        fixed = OPEN_REQUEST.pack(
            m.kind, m.wire_mode, m.max_k, m.flags, m.top_k, m.temperature, m.top_p, m.seed
        )
    except struct.error as exc:
        raise _bad(f"open request field out of range: {exc}") from None
    return fixed + _str8(m.name)


def decode_open_request(data: bytes) -> OpenRequest:
    r = _Reader(data)
    kind, wire_mode, max_k, flags, top_k, temperature, top_p, seed = r.take(OPEN_REQUEST)
    name = r.str8()
    r.end()
    return OpenRequest(kind, name, wire_mode, max_k, top_k, flags, temperature, top_p, seed)


@dataclass(frozen=True)
class OpenReply:
    handle: int
    context: int
    max_k: int


def encode_open_reply(m: OpenReply) -> bytes:
    return OPEN_REPLY.pack(m.handle, m.context, m.max_k)


def decode_open_reply(data: bytes) -> OpenReply:
    r = _Reader(data)
    values = r.take(OPEN_REPLY)
    r.end()
    return OpenReply(*values)


# ---------------------------------------------------------------- PREFILL / ROLLBACK / lengths


def encode_tokens(tokens: list[int] | tuple[int, ...]) -> bytes:
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error:
        raise _bad("token ids must be integers in 0..2**32-1") from None


def decode_tokens(data: bytes) -> tuple[int, ...]:
    if len(data) % 4:
        raise _bad(f"token payload of {len(data)} bytes is not a whole number of u32")
    return struct.unpack(f"<{len(data) // 4}I", data)


def encode_u32(value: int) -> bytes:
    try:
        return U32.pack(value)
    except struct.error:
        raise _bad(f"{value} does not fit in u32") from None


def decode_u32(data: bytes) -> int:
    if len(data) != 4:
        raise _bad(f"expected a 4-byte u32, got {len(data)} bytes")
    return U32.unpack(data)[0]


def encode_u8(value: int) -> bytes:
    try:
        return U8.pack(value)
    except struct.error:
        raise _bad(f"{value} does not fit in u8") from None


def decode_u8(data: bytes) -> int:
    if len(data) != 1:
        raise _bad(f"expected a 1-byte u8, got {len(data)} bytes")
    return data[0]


# ---------------------------------------------------------------- COMMIT


@dataclass(frozen=True)
class CommitRequest:
    accepted: int
    bonus: int
    next_k: int


def encode_commit_request(m: CommitRequest) -> bytes:
    try:
        return COMMIT_REQUEST.pack(m.accepted, m.next_k, m.bonus)
    except struct.error:
        raise _bad("commit fields out of range") from None


def decode_commit_request(data: bytes) -> CommitRequest:
    if len(data) != COMMIT_REQUEST.size:
        raise _bad(f"commit payload must be {COMMIT_REQUEST.size} bytes, got {len(data)}")
    accepted, next_k, bonus = COMMIT_REQUEST.unpack(data)
    return CommitRequest(accepted, bonus, next_k)


# ---------------------------------------------------------------- DRAFT reply


def encode_dist(d: Distribution) -> bytes:
    n = len(d.tokens)
    if not 1 <= n <= MAX_DIST_ENTRIES or len(d.weights) != n:
        raise _bad(f"a distribution needs 1..{MAX_DIST_ENTRIES} (token, weight) entries")
    try:
        return U8.pack(n) + TOKENS[n].pack(*d.tokens) + WEIGHTS[n].pack(*d.weights)
    except struct.error:
        raise _bad("distribution token or weight out of range") from None


def draft_reply_payload(
    prefetch_hit: bool,
    draft: bytes,
    dists: tuple[Distribution, ...] | None = None,
    lookup: bool = False,
) -> bytes:
    """A DRAFT or COMMIT reply's payload from the drafted tokens as the card keeps them (u32
    LE bytes): what the card sends every round."""
    n = len(draft) >> 2
    flags = (DraftFlags.PREFETCH_HIT if prefetch_hit else 0) | (DraftFlags.LOOKUP if lookup else 0)
    if dists is None:
        return DRAFT_REPLY_HEAD.pack(flags, n) + draft
    if len(dists) != n:
        raise _bad("a draft needs one distribution per token")
    head = DRAFT_REPLY_HEAD.pack(flags | DraftFlags.HAS_DIST, n)
    return head + draft + b"".join(encode_dist(d) for d in dists)


def one_hot_reply_payload(prefetch_hit: bool, draft: bytes, lookup: bool = False) -> bytes:
    """``draft_reply_payload`` of a deterministic draft in DIST mode, each token's
    distribution that token alone with weight 1, without building the distributions: what a
    greedy stream's card sends every round."""
    n = len(draft) >> 2
    flags = (DraftFlags.PREFETCH_HIT if prefetch_hit else 0) | (DraftFlags.LOOKUP if lookup else 0)
    one_hot = b"".join([b"\x01" + draft[i : i + 4] + b"\x01\x00" for i in range(0, n << 2, 4)])
    return DRAFT_REPLY_HEAD.pack(flags | DraftFlags.HAS_DIST, n) + draft + one_hot


def encode_draft_reply(m: Draft) -> bytes:
    n = len(m.tokens)
    if n > 255:
        raise _bad("a draft has at most 255 tokens")
    try:
        draft = TOKENS[n].pack(*m.tokens)
    except struct.error:
        raise _bad("token ids must be integers in 0..2**32-1") from None
    return draft_reply_payload(m.prefetch_hit, draft, m.dists, m.lookup)


def parse_draft_reply_frame(frame: bytes) -> Draft:
    """The draft in a checked DRAFT or COMMIT reply frame: what the host reads every round
    (a plain draft straight from the frame; anything else through ``decode_draft_reply``)."""
    n = len(frame)
    flags, count = (
        DRAFT_REPLY_HEAD.unpack_from(frame, HEADER_SIZE) if n > FRAME_OVERHEAD else (0, 0)
    )
    if flags & ~_PLAIN_DRAFT_FLAGS or n != FRAME_OVERHEAD + 2 + 4 * count:
        return decode_draft_reply(frame[HEADER_SIZE:-CRC_SIZE])  # dists, odd flags, bad length
    tokens = TOKENS[count].unpack_from(frame, HEADER_SIZE + 2)
    return Draft(tokens, bool(flags & _HIT), None, bool(flags & _LOOKUP))


# The request frames of a round, header and payload in one precompiled struct each.
COMMIT_FRAME = struct.Struct("<BBHIIBBI")  # header, then accepted, next_k, bonus
DRAFT_FRAME = struct.Struct("<BBHIIB")  # header, then k


def commit_frame(rid: int, handle: int, verdict: Verdict, next_k: int) -> bytes:
    """A COMMIT frame (struct.error for a field out of range)."""
    return seal(
        COMMIT_FRAME.pack(
            PROTOCOL_VERSION,
            Opcode.COMMIT,
            rid,
            handle,
            COMMIT_REQUEST.size,
            verdict.accepted,
            next_k,
            verdict.token,
        )
    )


def draft_frame(rid: int, handle: int, k: int) -> bytes:
    """A DRAFT frame (struct.error for a K out of range)."""
    return seal(DRAFT_FRAME.pack(PROTOCOL_VERSION, Opcode.DRAFT, rid, handle, 1, k))


def _read_dist(r: _Reader) -> Distribution:
    (m,) = r.take(U8)
    if m == 0:
        raise _bad("a distribution has no entries")
    dist_tokens = r.take(TOKENS[m])
    weights = r.take(WEIGHTS[m])
    if not any(weights):
        raise _bad("a distribution's weights sum to zero")
    return Distribution(dist_tokens, weights)


def decode_draft_reply(data: bytes) -> Draft:
    try:
        flags, n = DRAFT_REPLY_HEAD.unpack_from(data)
        tokens = TOKENS[n].unpack_from(data, 2)
    except struct.error:
        raise _bad("draft reply ends inside its tokens") from None
    if flags & ~_KNOWN_DRAFT_FLAGS & 0xFF:
        raise _bad(f"draft reply has unknown flags 0x{flags:02x}")
    pos = 2 + 4 * n
    dists = None
    if flags & DraftFlags.HAS_DIST:
        r = _Reader(data)
        r.pos = pos
        dists = tuple(_read_dist(r) for _ in range(n))
        pos = r.pos
    if pos != len(data):
        raise _bad(f"{len(data) - pos} unexpected bytes after the draft")
    return Draft(
        tokens, bool(flags & DraftFlags.PREFETCH_HIT), dists, bool(flags & DraftFlags.LOOKUP)
    )


# ---------------------------------------------------------------- token trees

TREE_REQUEST = struct.Struct("<BBB")  # nodes, top_k, depth
COMMIT_TREE_HEAD = struct.Struct("<IBBBB")  # bonus, next nodes, top_k, depth, path length
DRAFT_TREE_FRAME = struct.Struct("<BBHIIBBB")  # header, then nodes, top_k, depth


@dataclass(frozen=True)
class TreeRequest:
    """A tree's shape: at most ``nodes`` nodes, each with at most ``top_k`` children (1: a
    chain of ``nodes`` tokens), at most ``depth`` deep (0: as deep as the card likes)."""

    nodes: int
    top_k: int
    depth: int = 0

    @property
    def levels(self) -> int:
        """How deep the tree may be: ``depth``, where set, and never more than ``nodes``."""
        return min(self.depth or self.nodes, self.nodes)


def encode_tree_request(m: TreeRequest) -> bytes:
    try:
        return TREE_REQUEST.pack(m.nodes, m.top_k, m.depth)
    except struct.error:
        raise _bad("tree nodes, top_k and depth must be 0..255") from None


def decode_tree_request(data: bytes) -> TreeRequest:
    if len(data) != TREE_REQUEST.size:
        raise _bad(f"DRAFT_TREE payload must be {TREE_REQUEST.size} bytes, got {len(data)}")
    return TreeRequest(*TREE_REQUEST.unpack(data))


@dataclass(frozen=True)
class CommitTreeRequest:
    path: tuple[int, ...]
    """The accepted nodes of the last draft, from the context on (a chain's: 0..accepted-1)."""
    bonus: int
    next: TreeRequest
    """The next tree's shape (0 nodes: no next draft)."""


def encode_commit_tree_request(m: CommitTreeRequest) -> bytes:
    n = len(m.path)
    try:
        head = COMMIT_TREE_HEAD.pack(m.bonus, m.next.nodes, m.next.top_k, m.next.depth, n)
        return head + bytes(m.path)
    except (struct.error, ValueError):
        raise _bad("commit tree fields out of range") from None


def decode_commit_tree_request(data: bytes) -> CommitTreeRequest:
    try:
        bonus, nodes, top_k, depth, n = COMMIT_TREE_HEAD.unpack_from(data)
    except struct.error:
        raise _bad("COMMIT_TREE payload ends inside its header") from None
    if len(data) != COMMIT_TREE_HEAD.size + n:
        raise _bad(f"COMMIT_TREE with a path of {n} must be {COMMIT_TREE_HEAD.size + n} bytes")
    path = tuple(data[COMMIT_TREE_HEAD.size :])
    return CommitTreeRequest(path, bonus, TreeRequest(nodes, top_k, depth))


def tree_reply_payload(
    prefetch_hit: bool,
    draft: bytes,
    parents: bytes,
    lookup: bool,
    dists: Sequence[Distribution] | None = None,
) -> bytes:
    """A DRAFT_TREE or COMMIT_TREE reply's payload: flags, count, the tokens (u32 LE, as the
    card keeps them), then each node's parent (u8; TREE_ROOT for the context). With ``dists``
    (a sampled stream in DIST mode: per node, the distribution it was drawn from), the
    HAS_DIST flag and, after the parents, each parent's distribution once, where its first
    child is: siblings were drawn from one distribution, one after another."""
    flags = (DraftFlags.PREFETCH_HIT if prefetch_hit else 0) | (DraftFlags.LOOKUP if lookup else 0)
    if dists is None:
        return DRAFT_REPLY_HEAD.pack(flags, len(parents)) + draft + parents
    if len(dists) != len(parents):
        raise _bad("a sampled tree needs one distribution per node")
    first: dict[int, Distribution] = {}
    for p, d in zip(parents, dists, strict=True):
        if first.setdefault(p, d) != d:
            raise _bad("siblings are drawn from one distribution; these differ")
    head = DRAFT_REPLY_HEAD.pack(flags | DraftFlags.HAS_DIST, len(parents))
    return head + draft + parents + b"".join(encode_dist(d) for d in first.values())


def encode_tree_reply(m: Draft) -> bytes:
    n = len(m.tokens)
    parents = m.parents if m.parents is not None else chain_links(n)
    if n > MAX_TREE_NODES or len(parents) != n:
        raise _bad(f"a tree has at most {MAX_TREE_NODES} nodes, one parent each")
    try:
        draft = TOKENS[n].pack(*m.tokens)
        wire = bytes(TREE_ROOT if p < 0 else p for p in parents)
    except (struct.error, ValueError):
        raise _bad("token ids must be u32 and parents node indices") from None
    return tree_reply_payload(m.prefetch_hit, draft, wire, m.lookup, m.dists)


def decode_tree_reply(data: bytes) -> Draft:
    try:
        flags, n = DRAFT_REPLY_HEAD.unpack_from(data)
        tokens = TOKENS[n].unpack_from(data, 2)
    except struct.error:
        raise _bad("tree reply ends inside its tokens") from None
    if flags & ~_KNOWN_DRAFT_FLAGS & 0xFF:
        raise _bad(f"tree reply has unknown flags 0x{flags:02x}")
    end = 2 + 5 * n
    if n > MAX_TREE_NODES or len(data) < end or (len(data) > end and not flags & _DIST):
        raise _bad(f"a tree reply of {n} nodes must be {2 + 5 * n} bytes, at most {MAX_TREE_NODES}")
    wire = data[2 + 4 * n : end]
    parents = parents_from_wire(wire)
    if any(p >= i for i, p in enumerate(parents)):
        raise _bad("a tree node's parent must come before it")
    dists = None
    if flags & _DIST:
        r = _Reader(data)
        r.pos = end
        of_parent: dict[int, Distribution] = {}
        for p in wire:
            if p not in of_parent:
                of_parent[p] = _read_dist(r)
        if r.pos != len(data):
            raise _bad(f"{len(data) - r.pos} unexpected bytes after the tree")
        dists = tuple(of_parent[p] for p in wire)
    return Draft(tokens, bool(flags & _HIT), dists, bool(flags & _LOOKUP), chain_or_tree(parents))


def draft_tree_frame(rid: int, handle: int, shape: TreeRequest) -> bytes:
    """A DRAFT_TREE frame (struct.error for a field out of range)."""
    return seal(
        DRAFT_TREE_FRAME.pack(
            PROTOCOL_VERSION,
            Opcode.DRAFT_TREE,
            rid,
            handle,
            TREE_REQUEST.size,
            shape.nodes,
            shape.top_k,
            shape.depth,
        )
    )


def commit_tree_frame(rid: int, handle: int, verdict: Verdict, shape: TreeRequest) -> bytes:
    """A COMMIT_TREE frame for ``verdict`` (its path; a chain draft's verdict names its
    accepted prefix), asking for a next tree of ``shape``."""
    path = verdict.path or tuple(range(verdict.accepted))
    payload = encode_commit_tree_request(CommitTreeRequest(path, verdict.token, shape))
    return pack_frame(Opcode.COMMIT_TREE, rid, handle, payload)


def parents_from_wire(wire: bytes) -> tuple[int, ...]:
    """A tree's parents as the host holds them (-1 for the context) from their wire bytes (u8,
    TREE_ROOT for the context)."""
    return tuple(-1 if p == TREE_ROOT else p for p in wire)


def check_path(parents: bytes, path: bytes) -> bool:
    """Whether ``path`` (u8 node indices) is a path from the context in a tree of wire
    ``parents`` (u8, TREE_ROOT for the context)."""
    return path_ok(parents_from_wire(parents), list(path))


def parse_tree_reply_frame(frame: bytes) -> Draft:
    """The tree in a checked DRAFT_TREE or COMMIT_TREE reply frame."""
    return decode_tree_reply(frame[HEADER_SIZE:-CRC_SIZE])


# ---------------------------------------------------------------- ERROR


@dataclass(frozen=True)
class ErrorReply:
    code: int
    message: str


def encode_error_reply(m: ErrorReply) -> bytes:
    raw = m.message.encode("utf-8")[:MAX_ERROR_MESSAGE]
    return U16.pack(m.code) + raw.decode("utf-8", "ignore").encode("utf-8")


def decode_error_reply(data: bytes) -> ErrorReply:
    r = _Reader(data)
    (code,) = r.take(U16)
    raw = r.rest()
    if len(raw) > MAX_ERROR_MESSAGE:
        raise _bad("error message too long")
    return ErrorReply(code, raw.decode("utf-8", "replace"))


# ---------------------------------------------------------------- image store (flashing)

UPLOAD_BEGIN = struct.Struct("<Q32sB")  # size, sha256, flags
UPLOAD_BEGIN_REPLY = struct.Struct("<QI")  # resume offset, largest chunk
UPLOAD_CHUNK_HEAD = struct.Struct("<QI")  # offset, crc32 of the data
UPLOAD_FLAG_ALLOW_DOWNGRADE = 0x01
IMAGE_ENTRY = struct.Struct("<BBQ32s")  # slot, state, size, sha256


@dataclass(frozen=True)
class UploadBegin:
    size: int
    sha256: bytes
    target: str
    version: str
    allow_downgrade: bool = False


def encode_upload_begin(m: UploadBegin) -> bytes:
    flags = UPLOAD_FLAG_ALLOW_DOWNGRADE if m.allow_downgrade else 0
    try:
        fixed = UPLOAD_BEGIN.pack(m.size, m.sha256, flags)
    except struct.error:
        raise _bad("upload size or digest out of range") from None
    return fixed + _str8(m.target) + _str8(m.version)


def decode_upload_begin(data: bytes) -> UploadBegin:
    r = _Reader(data)
    size, sha256, flags = r.take(UPLOAD_BEGIN)
    target, version = r.str8(), r.str8()
    r.end()
    if flags & ~UPLOAD_FLAG_ALLOW_DOWNGRADE:
        raise _bad(f"unknown upload flags 0x{flags:02x}")
    return UploadBegin(size, sha256, target, version, bool(flags))


def encode_name(name: str) -> bytes:
    return _str8(name)


def decode_name(data: bytes) -> str:
    r = _Reader(data)
    name = r.str8()
    r.end()
    return name


@dataclass(frozen=True)
class ImageEntry:
    target: str
    slot: int
    """0 = slot A, 1 = slot B."""
    state: int
    """ImageState."""
    version: str
    size: int
    sha256: bytes


def encode_image_list(entries: list[ImageEntry]) -> bytes:
    parts = [U8.pack(len(entries))]
    for e in entries:
        parts += [
            _str8(e.target),
            IMAGE_ENTRY.pack(e.slot, e.state, e.size, e.sha256),
            _str8(e.version),
        ]
    return b"".join(parts)


def decode_image_list(data: bytes) -> list[ImageEntry]:
    r = _Reader(data)
    (n,) = r.take(U8)
    out = []
    for _ in range(n):
        target = r.str8()
        slot, state, size, sha = r.take(IMAGE_ENTRY)
        out.append(ImageEntry(target, slot, state, r.str8(), size, sha))
    r.end()
    return out
