"""Image metadata: typed key/value entries (like GGUF's), encoded with the construct schema."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import construct as c

from exstill_sdk.errors import ImageError
from exstill_sdk.image.format import (
    MAX_ARRAY_ITEMS,
    MAX_KEY_BYTES,
    MAX_METADATA_BYTES,
    MAX_METADATA_ENTRIES,
    MAX_STRING_BYTES,
    MetaType,
)
from exstill_sdk.image.schema import METADATA

MetaValue = int | float | bool | str | bytes | list[int]


def _type_of(key: str, value: Any) -> int:
    if isinstance(value, bool):
        return MetaType.BOOL
    if isinstance(value, int):
        return MetaType.U64 if value >= 0 else MetaType.I64
    if isinstance(value, float):
        return MetaType.F64
    if isinstance(value, str):
        return MetaType.STR
    if isinstance(value, bytes):
        return MetaType.BYTES
    if isinstance(value, list) and all(isinstance(v, int) and v >= 0 for v in value):
        return MetaType.U64_ARRAY
    raise ValueError(f"metadata {key!r}: {type(value).__name__} values cannot be stored")


def encode_metadata(meta: Mapping[str, Any]) -> bytes:
    entries = [{"key": k, "type": _type_of(k, v), "value": v} for k, v in meta.items()]
    data = METADATA.build({"count": len(entries), "entries": entries})
    if len(data) > MAX_METADATA_BYTES or len(entries) > MAX_METADATA_ENTRIES:
        raise ValueError("metadata is larger than the format allows")
    return data


def decode_metadata(data: bytes) -> dict[str, MetaValue]:
    """Parse metadata bytes (already bounded by MAX_METADATA_BYTES); ImageError if malformed."""
    if len(data) < 4:
        raise ImageError("metadata is shorter than its entry count")
    count = int.from_bytes(data[:4], "little")
    if count > MAX_METADATA_ENTRIES:
        raise ImageError(f"metadata claims {count} entries; at most {MAX_METADATA_ENTRIES}")
    try:
        parsed = METADATA.parse(data)
    except (c.ConstructError, UnicodeDecodeError) as exc:
        raise ImageError(f"metadata is malformed: {_first_line(exc)}") from None
    out: dict[str, MetaValue] = {}
    for entry in parsed.entries:
        key, value = entry.key, entry.value
        if not key or len(key.encode()) > MAX_KEY_BYTES:
            raise ImageError(
                f"metadata key {key[:40]!r} is empty or longer than {MAX_KEY_BYTES} bytes"
            )
        if key in out:
            raise ImageError(f"metadata key {key!r} appears twice")
        if isinstance(value, str | bytes) and len(value) > MAX_STRING_BYTES:
            raise ImageError(f"metadata {key!r} is longer than {MAX_STRING_BYTES} bytes")
        if isinstance(value, c.ListContainer | list):
            if len(value) > MAX_ARRAY_ITEMS:
                raise ImageError(f"metadata {key!r} has more than {MAX_ARRAY_ITEMS} items")
            value = list(value)
        out[key] = value
    return out


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
