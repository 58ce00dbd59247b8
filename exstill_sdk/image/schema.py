"""The card image format v1 in ``construct``: the one definition both the writer and the reader
use. Readers parse each region from a slice whose size was checked against the caps first, so
no count or length in the file can make construct read or allocate past it."""

from __future__ import annotations

import construct as c

from exstill_sdk.image.format import HEADER_SIZE, MAGIC, TRAILER_MAGIC, TRAILER_SIZE, MetaType

HEADER = c.Struct(
    "magic" / c.Const(MAGIC),
    "format_version" / c.Int16ul,
    "header_size" / c.Int16ul,
    "flags" / c.Int32ul,
    "meta_offset" / c.Int64ul,
    "meta_size" / c.Int64ul,
    "table_offset" / c.Int64ul,
    "table_size" / c.Int64ul,
    "tensor_count" / c.Int32ul,
    "reserved0" / c.Int32ul,
    "data_offset" / c.Int64ul,
    "data_size" / c.Int64ul,
    "reserved" / c.Bytes(HEADER_SIZE - 72),
)
assert HEADER.sizeof() == HEADER_SIZE

META_VALUE = c.Switch(
    c.this.type,
    {
        MetaType.U64: c.Int64ul,
        MetaType.I64: c.Int64sl,
        MetaType.F64: c.Float64l,
        MetaType.BOOL: c.Flag,
        MetaType.STR: c.PascalString(c.Int32ul, "utf8"),
        MetaType.BYTES: c.Prefixed(c.Int32ul, c.GreedyBytes),
        MetaType.U64_ARRAY: c.PrefixedArray(c.Int32ul, c.Int64ul),
    },
    default=c.Error,
)

META_ENTRY = c.Struct(
    "key" / c.PascalString(c.Int16ul, "utf8"),
    "type" / c.Int8ul,
    "value" / META_VALUE,
)

METADATA = c.Struct(
    "count" / c.Int32ul,
    "entries" / c.Array(c.this.count, META_ENTRY),
    c.Terminated,
)

TENSOR = c.Struct(
    "name" / c.PascalString(c.Int16ul, "utf8"),
    "dtype" / c.Int8ul,
    "ndim" / c.Int8ul,
    "shape" / c.Array(c.this.ndim, c.Int64ul),
    "offset" / c.Int64ul,
    "size" / c.Int64ul,
)

TRAILER = c.Struct(
    "magic" / c.Const(TRAILER_MAGIC),
    "trailer_version" / c.Int16ul,
    "flags" / c.Int16ul,
    "reserved" / c.Int32ul,
    "digest" / c.Bytes(32),
    "key_id" / c.Bytes(32),
    "signature" / c.Bytes(64),
)
assert TRAILER.sizeof() == TRAILER_SIZE
TRAILER_SIGNED = 0x0001
