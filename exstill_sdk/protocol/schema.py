"""The formal schema of wire protocol v1, in ``construct``.

This is the normative machine-readable definition that docs/protocol.md describes in prose.
The runtime and the client use the precompiled ``struct`` codec in ``messages.py`` and
``frame.py`` for speed; tests/protocol/test_schema_agreement.py shows that both produce and
accept the same bytes for every message. ``describe_frame`` uses it to print traced frames.
"""

from __future__ import annotations

import zlib
from typing import Any

import construct as c

from exstill_sdk.protocol.constants import MAX_TREE_NODES, RESPONSE_BIT, TREE_ROOT, Opcode

Str8 = c.PascalString(c.Int8ul, "utf8")

FRAME_HEADER = c.Struct(
    "version" / c.Int8ul,
    "opcode" / c.Int8ul,
    "request_id" / c.Int16ul,
    "handle" / c.Int32ul,
    "length" / c.Int32ul,
)

FRAME = c.Struct(
    "header" / FRAME_HEADER,
    "payload" / c.Bytes(c.this.header.length),
    "crc"
    / c.Checksum(
        c.Int32ul,
        zlib.crc32,
        lambda ctx: FRAME_HEADER.build(ctx.header) + ctx.payload,
    ),
    c.Terminated,
)

HELLO_REQUEST = c.Struct(
    "min_version" / c.Int8ul, "max_version" / c.Int8ul, "client" / Str8, c.Terminated
)

TARGET_INFO = c.Struct("name" / Str8, "vocab_size" / c.Int32ul, "tokenizer_sha256" / c.Bytes(32))

HELLO_REPLY = c.Struct(
    "version" / c.Int8ul,
    "firmware" / Str8,
    "slots" / c.Int16ul,
    "context" / c.Int32ul,
    "max_k" / c.Int8ul,
    "wire_modes" / c.Int8ul,
    "features" / c.Int32ul,
    "max_payload" / c.Int32ul,
    "engines" / c.PrefixedArray(c.Int8ul, Str8),
    "targets" / c.PrefixedArray(c.Int8ul, TARGET_INFO),
    c.Terminated,
)

STATS_REPLY = c.Struct(
    "counters" / c.PrefixedArray(c.Int16ul, c.Struct("name" / Str8, "value" / c.Int64ul)),
    c.Terminated,
)

OPEN_REQUEST = c.Struct(
    "kind" / c.Int8ul,
    "wire_mode" / c.Int8ul,
    "max_k" / c.Int8ul,
    "flags" / c.Int8ul,
    "top_k" / c.Int16ul,
    "temperature" / c.Float32l,
    "top_p" / c.Float32l,
    "seed" / c.Int64ul,
    "name" / Str8,
    c.Terminated,
)

OPEN_REPLY = c.Struct("handle" / c.Int32ul, "context" / c.Int32ul, "max_k" / c.Int8ul, c.Terminated)

TOKENS = c.Struct("tokens" / c.GreedyRange(c.Int32ul), c.Terminated)
LENGTH = c.Struct("length" / c.Int32ul, c.Terminated)
DRAFT_REQUEST = c.Struct("k" / c.Int8ul, c.Terminated)
EMPTY = c.Struct(c.Terminated)

COMMIT_REQUEST = c.Struct(
    "accepted" / c.Int8ul, "next_k" / c.Int8ul, "bonus" / c.Int32ul, c.Terminated
)

DISTRIBUTION = c.Struct(
    "n" / c.Int8ul,
    c.Check(c.this.n >= 1),
    "tokens" / c.Array(c.this.n, c.Int32ul),
    "weights" / c.Array(c.this.n, c.Int16ul),
    c.Check(lambda ctx: sum(ctx.weights) > 0),
)

DRAFT_REPLY = c.Struct(
    "flags"
    / c.BitStruct(
        "reserved" / c.Const(0, c.BitsInteger(5)),
        "lookup" / c.Flag,
        "has_dist" / c.Flag,
        "prefetch_hit" / c.Flag,
    ),
    "count" / c.Int8ul,
    "tokens" / c.Array(c.this.count, c.Int32ul),
    "dists" / c.If(c.this.flags.has_dist, c.Array(c.this.count, DISTRIBUTION)),
    c.Terminated,
)

TREE_REQUEST = c.Struct("nodes" / c.Int8ul, "top_k" / c.Int8ul, "depth" / c.Int8ul, c.Terminated)

COMMIT_TREE_REQUEST = c.Struct(
    "bonus" / c.Int32ul,
    "next_nodes" / c.Int8ul,
    "next_top_k" / c.Int8ul,
    "next_depth" / c.Int8ul,
    "length" / c.Int8ul,
    "path" / c.Array(c.this.length, c.Int8ul),
    c.Terminated,
)

TREE_REPLY = c.Struct(
    "flags"
    / c.BitStruct(
        "reserved" / c.Const(0, c.BitsInteger(5)),
        "lookup" / c.Flag,
        "has_dist" / c.Flag,
        "prefetch_hit" / c.Flag,
    ),
    "count" / c.Int8ul,
    c.Check(c.this.count <= MAX_TREE_NODES),
    "tokens" / c.Array(c.this.count, c.Int32ul),
    "parents" / c.Array(c.this.count, c.Int8ul),
    c.Check(lambda ctx: all(p == TREE_ROOT or p < i for i, p in enumerate(ctx.parents))),
    "dists" / c.If(c.this.flags.has_dist, c.Array(lambda ctx: len(set(ctx.parents)), DISTRIBUTION)),
    c.Terminated,
)
"""A token tree: node i's parent is ``parents[i]`` (an earlier node, or TREE_ROOT for the
context). A sampled stream's tree (DIST mode) carries each parent's distribution once, in the
order of its first child: its children were drawn from it one after another, without
replacement."""

ERROR_REPLY = c.Struct("code" / c.Int16ul, "message" / c.GreedyString("utf8"), c.Terminated)

PING = c.Struct("data" / c.GreedyBytes)

REQUEST_PAYLOADS: dict[Opcode, c.Construct] = {
    Opcode.HELLO: HELLO_REQUEST,
    Opcode.PING: PING,
    Opcode.STATS: EMPTY,
    Opcode.OPEN: OPEN_REQUEST,
    Opcode.CLOSE: EMPTY,
    Opcode.PREFILL: TOKENS,
    Opcode.DRAFT: DRAFT_REQUEST,
    Opcode.COMMIT: COMMIT_REQUEST,
    Opcode.ROLLBACK: LENGTH,
    Opcode.DRAFT_TREE: TREE_REQUEST,
    Opcode.COMMIT_TREE: COMMIT_TREE_REQUEST,
}

REPLY_PAYLOADS: dict[Opcode, c.Construct] = {
    Opcode.HELLO: HELLO_REPLY,
    Opcode.PING: PING,
    Opcode.STATS: STATS_REPLY,
    Opcode.OPEN: OPEN_REPLY,
    Opcode.CLOSE: EMPTY,
    Opcode.PREFILL: LENGTH,
    Opcode.DRAFT: DRAFT_REPLY,
    Opcode.COMMIT: DRAFT_REPLY,
    Opcode.ROLLBACK: LENGTH,
    Opcode.DRAFT_TREE: TREE_REPLY,
    Opcode.COMMIT_TREE: TREE_REPLY,
    Opcode.ERROR: ERROR_REPLY,
}


def payload_schema(opcode: int) -> c.Construct | None:
    """The schema of a frame's payload, from its opcode (request or response)."""
    if opcode == Opcode.ERROR:
        return ERROR_REPLY
    table = REPLY_PAYLOADS if opcode & RESPONSE_BIT else REQUEST_PAYLOADS
    try:
        return table.get(Opcode(opcode & ~RESPONSE_BIT))
    except ValueError:
        return None


def describe_frame(data: bytes) -> dict[str, Any]:
    """A readable dict of one frame's fields, for packet tracing; never raises on bad bytes."""
    try:
        frame = FRAME.parse(data)
    except c.ConstructError as exc:
        return {"error": f"undecodable frame: {exc}", "bytes": data.hex()}
    op = frame.header.opcode
    try:
        name = Opcode(op & ~RESPONSE_BIT if op != Opcode.ERROR else op).name
    except ValueError:
        name = f"0x{op:02x}"
    out: dict[str, Any] = {
        "op": name + (" reply" if op & RESPONSE_BIT and op != Opcode.ERROR else ""),
        "rid": frame.header.request_id,
        "handle": f"0x{frame.header.handle:08x}",
    }
    schema = payload_schema(op)
    if schema is None:
        out["payload"] = frame.payload.hex()
        return out
    try:
        parsed = schema.parse(frame.payload)
    except c.ConstructError as exc:
        out["payload_error"] = str(exc)
        return out
    out.update({k: v for k, v in parsed.items() if not k.startswith("_")})
    return out
