"""Numbers of wire protocol v1: opcodes, error codes, flags and limits (docs/protocol.md)."""

from __future__ import annotations

from enum import IntEnum, IntFlag

PROTOCOL_VERSION = 1
"""The only frame version this code speaks; HELLO negotiates it."""

HEADER_SIZE = 12
"""version u8, opcode u8, request_id u16, handle u32, length u32."""
CRC_SIZE = 4
FRAME_OVERHEAD = HEADER_SIZE + CRC_SIZE
MAX_PAYLOAD = 1 << 20
"""Largest payload a v1 peer must accept; bigger frames are dropped unread."""
MAX_FRAME = FRAME_OVERHEAD + MAX_PAYLOAD

MAX_NAME = 64
"""Longest engine, target or counter name (UTF-8 bytes)."""
MAX_ERROR_MESSAGE = 200
MAX_DIST_ENTRIES = 255
"""Most entries a drafted position's distribution may carry on the wire."""
MAX_TREE_NODES = 64
"""Most nodes a token tree may have (DRAFT_TREE, COMMIT_TREE; Features.TREES)."""
MAX_TREE_TOP_K = 16
"""Most children a tree node may have."""
TREE_ROOT = 0xFF
"""A tree node's parent index on the wire when its parent is the context itself."""

RESPONSE_BIT = 0x80
"""A response's opcode is its request's opcode with this bit set."""


class Opcode(IntEnum):
    HELLO = 0x01
    PING = 0x02
    STATS = 0x03
    OPEN = 0x10
    CLOSE = 0x11
    PREFILL = 0x12
    DRAFT = 0x13
    COMMIT = 0x14
    ROLLBACK = 0x15
    DRAFT_TREE = 0x16
    """Draft a token tree (Features.TREES): nodes, top-k; the reply is a TREE reply."""
    COMMIT_TREE = 0x17
    """A round on a tree (or chain) draft: the accepted path, the target's token, the next
    tree's shape; the reply is the next TREE reply."""
    UPLOAD_BEGIN = 0x20
    UPLOAD_CHUNK = 0x21
    UPLOAD_END = 0x22
    ACTIVATE = 0x23
    CONFIRM = 0x24
    REVERT = 0x25
    LIST_IMAGES = 0x26
    ERASE = 0x27
    AUTH_CHALLENGE = 0x28
    AUTH = 0x29
    ERROR = 0xFF
    """Response-only: a typed error for the request with the same request id."""


class ErrorCode(IntEnum):
    """Codes carried by ERROR replies (1..255) and host-side codes (256 and up)."""

    BAD_FRAME = 0x01
    UNSUPPORTED_VERSION = 0x02
    UNKNOWN_OPCODE = 0x03
    BAD_PAYLOAD = 0x04
    HANDSHAKE_REQUIRED = 0x05
    BAD_HANDLE = 0x06
    CARD_FULL = 0x07
    K_OUT_OF_RANGE = 0x08
    CONTEXT_FULL = 0x09
    UNKNOWN_MODEL = 0x0A
    BAD_ARGUMENT = 0x0B
    INTERNAL = 0x0C
    BAD_IMAGE = 0x0D
    BAD_SIGNATURE = 0x0E
    STORE_FULL = 0x0F
    DOWNGRADE_REFUSED = 0x10
    BAD_CHUNK = 0x11
    NOT_AUTHORIZED = 0x12
    # Host side only: never sent on the wire.
    TIMEOUT = 0x100
    LINK = 0x101
    DEVICE_NOT_FOUND = 0x102
    PERMISSION = 0x103
    BAD_URL = 0x104
    TOKENIZER_MISMATCH = 0x105
    BAD_TARGET_OUTPUT = 0x106
    DEVICE_LOST = 0x107
    DEVICE_BUSY = 0x108


class ModelKind(IntEnum):
    ENGINE = 0
    """A weightless engine built into the runtime (for example "lookup")."""
    TARGET = 1
    """A target image: distilled draft weights for one target model."""


class WireMode(IntEnum):
    TOKENS = 0
    """Draft replies carry token ids only."""
    DIST = 1
    """Draft replies also carry, per position, the exact distribution the card sampled from."""


class OpenFlags(IntFlag):
    NONE = 0
    LONG_CONTEXT = 0x01
    """Keep drafting when the context outgrows the slot (attention sinks + sliding window)."""
    LOOKUP = 0x02
    """Target streams: draft by prompt lookup where the stream's text repeats, by the model
    elsewhere (firmware/engines/hybrid.py)."""


class DraftFlags(IntFlag):
    NONE = 0
    PREFETCH_HIT = 0x01
    HAS_DIST = 0x02
    LOOKUP = 0x04
    """The draft came from prompt lookup (a stream opened with OpenFlags.LOOKUP)."""


AUTH_NONCE_SIZE = 32
"""Bytes of the card's challenge, and of the host's HMAC-SHA256 answer."""
AUTH_CONTEXT = b"exstill-admin-v1\0"
"""What the answer's HMAC covers before the nonce: it proves the key for this purpose only."""
ADMIN_OPCODES = frozenset(
    {
        Opcode.UPLOAD_BEGIN,
        Opcode.UPLOAD_CHUNK,
        Opcode.UPLOAD_END,
        Opcode.ACTIVATE,
        Opcode.CONFIRM,
        Opcode.REVERT,
        Opcode.ERASE,
    }
)
STORE_OPCODES = ADMIN_OPCODES | {Opcode.LIST_IMAGES}
"""What a card with an image store (Features.IMAGE_STORE) serves beyond drafting."""
"""Administration: what changes the image store. On a network link it needs a session that
proved the card's admin key (AUTH)."""


class Features(IntFlag):
    NONE = 0
    PREFETCH = 0x01
    PIPELINING = 0x02
    IMAGE_STORE = 0x04
    """The card holds flashed images (UPLOAD_*, ACTIVATE, CONFIRM, REVERT, ERASE, LIST_IMAGES)."""
    TREES = 0x08
    """The card drafts token trees (DRAFT_TREE, COMMIT_TREE), up to MAX_TREE_NODES nodes."""
    OUTCOMES = 0x10
    """The card drafts ahead for several verification outcomes, not only full acceptance
    (docs/protocol.md section 8): a COMMIT of any of them is answered at once, with
    PREFETCH_HIT. Nothing on the wire changes; STATS counts hits by accepted length."""
    SAMPLED_TREES = 0x20
    """The card drafts token trees for sampled streams in DIST mode: each node's children drawn
    from its distribution without replacement, the distributions in the TreeReply (HAS_DIST)."""


class ImageState(IntEnum):
    """A store slot's state (LIST_IMAGES)."""

    PARTIAL = 0
    """An upload in progress (resumable)."""
    VERIFIED = 1
    """Uploaded and verified; not serving."""
    TESTING = 2
    """Serving on trial: reverts at the next card reset unless confirmed."""
    CONFIRMED = 3
    """Serving; survives resets."""
    PREVIOUS = 4
    """The previously confirmed image, kept for revert."""
    DAMAGED = 5
    """Failed the card's check at boot (truncated, missing or changed since it was verified):
    set aside, never served; erase the target or flash it again."""
