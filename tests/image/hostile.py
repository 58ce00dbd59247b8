"""Build hostile variants of a valid image: rewrite one field, and (optionally) re-seal the
digest so that the structural checks, not the digest, must catch it."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import construct as c

from exstill_sdk.image.format import HEADER_SIZE, TRAILER_SIZE
from exstill_sdk.image.schema import HEADER, METADATA, TENSOR, TRAILER


def split(image: bytes) -> dict[str, Any]:
    h = HEADER.parse(image[:HEADER_SIZE])
    return {
        "header": h,
        "meta": METADATA.parse(image[h.meta_offset : h.meta_offset + h.meta_size]),
        "table": c.Array(h.tensor_count, TENSOR).parse(
            image[h.table_offset : h.table_offset + h.table_size]
        ),
    }


def reseal(image: bytes) -> bytes:
    """Recompute the trailer digest (unsigned) over the (modified) body."""
    body = image[: len(image) - TRAILER_SIZE]
    trailer = TRAILER.parse(image[len(image) - TRAILER_SIZE :])
    trailer.digest = hashlib.sha256(body).digest()
    return body + TRAILER.build(trailer)


def with_header(image: bytes, **fields: int) -> bytes:
    h = HEADER.parse(image[:HEADER_SIZE])
    for k, v in fields.items():
        h[k] = v
    return reseal(HEADER.build(h) + image[HEADER_SIZE:])


def with_table(image: bytes, edit: Callable[[list], None]) -> bytes:
    """Edit the parsed tensor table in place; the table must keep its byte length."""
    h = HEADER.parse(image[:HEADER_SIZE])
    table = c.Array(h.tensor_count, TENSOR).parse(
        image[h.table_offset : h.table_offset + h.table_size]
    )
    edit(table)
    raw = c.Array(len(table), TENSOR).build(table)
    assert len(raw) == h.table_size, "edit changed the table's length"
    return reseal(image[: h.table_offset] + raw + image[h.table_offset + h.table_size :])


def with_metadata(image: bytes, edit: Callable[[dict], None]) -> bytes:
    """Edit metadata (a plain dict of key -> (type, value)); rebuilds the layout if its size
    changes by moving everything after it."""
    from exstill_sdk.image.format import ALIGNMENT, align

    h = HEADER.parse(image[:HEADER_SIZE])
    meta = METADATA.parse(image[h.meta_offset : h.meta_offset + h.meta_size])
    entries = {e.key: (e.type, e.value) for e in meta.entries}
    edit(entries)
    raw = METADATA.build(
        {
            "count": len(entries),
            "entries": [{"key": k, "type": t, "value": v} for k, (t, v) in entries.items()],
        }
    )
    table = image[h.table_offset : h.table_offset + h.table_size]
    data = image[h.data_offset : len(image) - TRAILER_SIZE]
    table_offset = align(HEADER_SIZE + len(raw), 8)
    data_offset = align(table_offset + len(table), ALIGNMENT)
    h.meta_size, h.table_offset, h.data_offset = len(raw), table_offset, data_offset
    body = HEADER.build(h) + raw
    body += bytes(table_offset - len(body)) + table
    body += bytes(data_offset - len(body)) + data
    return reseal(body + image[len(image) - TRAILER_SIZE :])
