"""Frames: a 12-byte header, the payload and a CRC-32 trailer (docs/protocol.md, "Frames").

This module is the struct fast path for the header; ``schema.FRAME`` is the formal definition.
"""

from __future__ import annotations

import struct
from typing import NamedTuple
from zlib import crc32

from exstill_sdk.errors import ProtocolError
from exstill_sdk.protocol.constants import (
    CRC_SIZE,
    FRAME_OVERHEAD,
    HEADER_SIZE,
    MAX_PAYLOAD,
    PROTOCOL_VERSION,
    ErrorCode,
)

HEADER = struct.Struct("<BBHII")
CRC = struct.Struct("<I")
assert HEADER.size == HEADER_SIZE and CRC.size == CRC_SIZE


class Frame(NamedTuple):
    version: int
    opcode: int
    request_id: int
    handle: int
    payload: bytes


def pack_frame(opcode: int, request_id: int, handle: int, payload: bytes = b"") -> bytes:
    """The bytes of one frame of this protocol version, for a payload the caller knows fits:
    the one frame builder of the request and reply paths (struct.error for a header field out
    of range)."""
    body = HEADER.pack(PROTOCOL_VERSION, opcode, request_id, handle, len(payload)) + payload
    return body + CRC.pack(crc32(body))


def encode_frame(
    opcode: int, request_id: int, handle: int, payload: bytes = b"", version: int = PROTOCOL_VERSION
) -> bytes:
    """The bytes of one frame (no byte-stream framing), its payload checked against the limit;
    ``version`` lets a test speak another version."""
    if len(payload) > MAX_PAYLOAD:
        raise ProtocolError(
            f"payload of {len(payload)} bytes exceeds the {MAX_PAYLOAD}-byte limit; "
            "split it (prefill is chunked for this reason)"
        )
    body = HEADER.pack(version, opcode, request_id, handle, len(payload)) + payload
    return body + CRC.pack(crc32(body))


def seal(body: bytes) -> bytes:
    """Append the CRC to a header+payload already packed by a caller's precompiled struct."""
    return body + CRC.pack(crc32(body))


def is_whole_frame(data: bytes) -> bool:
    """Whether ``data`` is one whole frame: its declared length and its CRC hold."""
    n = len(data)
    if n < FRAME_OVERHEAD:
        return False
    length = HEADER.unpack_from(data)[4]
    return (
        n == FRAME_OVERHEAD + length
        and crc32(memoryview(data)[: n - CRC_SIZE]) == CRC.unpack_from(data, n - CRC_SIZE)[0]
    )


def decode_frame(data: bytes) -> Frame:
    """Parse and check one frame; ProtocolError(BAD_FRAME) says why a frame must be dropped."""
    n = len(data)
    if n < FRAME_OVERHEAD:
        raise ProtocolError(f"frame of {n} bytes is shorter than a header", ErrorCode.BAD_FRAME)
    version, opcode, request_id, handle, length = HEADER.unpack_from(data)
    if length > MAX_PAYLOAD or n != FRAME_OVERHEAD + length:
        raise ProtocolError(
            f"frame of {n} bytes declares a {length}-byte payload", ErrorCode.BAD_FRAME
        )
    if crc32(memoryview(data)[: n - CRC_SIZE]) != CRC.unpack_from(data, n - CRC_SIZE)[0]:
        raise ProtocolError("frame CRC mismatch", ErrorCode.BAD_FRAME)
    return Frame(version, opcode, request_id, handle, bytes(data[HEADER_SIZE : n - CRC_SIZE]))
