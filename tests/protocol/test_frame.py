from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from exstill_sdk import ProtocolError
from exstill_sdk.protocol.constants import MAX_PAYLOAD, ErrorCode, Opcode
from exstill_sdk.protocol.frame import decode_frame, encode_frame


def test_frame_round_trip_and_layout() -> None:
    frame = encode_frame(Opcode.PING, 0x1234, 0xAABBCCDD, b"hi")
    # version, opcode, request id LE, handle LE, length LE, payload, CRC-32 LE
    assert frame[:12] == bytes.fromhex("01 02 3412 DDCCBBAA 02000000")
    assert frame[12:14] == b"hi"
    assert len(frame) == 18
    assert decode_frame(frame) == (1, Opcode.PING, 0x1234, 0xAABBCCDD, b"hi")


@pytest.mark.parametrize(
    "mangle",
    [
        lambda f: f[:-1],  # truncated
        lambda f: f + b"\x00",  # trailing byte
        lambda f: f[:5] + bytes([f[5] ^ 0x40]) + f[6:],  # flipped bit: CRC mismatch
        lambda f: f[:8] + b"\xff\xff\x00\x00" + f[12:],  # length beyond the frame
        lambda f: b"",
    ],
)
def test_bad_frames_raise_bad_frame(mangle) -> None:
    frame = encode_frame(Opcode.DRAFT, 7, 1, b"\x06")
    with pytest.raises(ProtocolError) as info:
        decode_frame(mangle(frame))
    assert info.value.code == ErrorCode.BAD_FRAME


def test_oversize_payload_is_refused_when_encoding() -> None:
    with pytest.raises(ProtocolError):
        encode_frame(Opcode.PREFILL, 1, 1, bytes(MAX_PAYLOAD + 1))


@given(st.binary(max_size=300))
def test_decode_frame_raises_only_protocol_error(data: bytes) -> None:
    try:
        frame = decode_frame(data)
    except ProtocolError:
        return
    assert (
        encode_frame(frame.opcode, frame.request_id, frame.handle, frame.payload, frame.version)
        == data
    )


@given(
    st.integers(0, 255),
    st.integers(0, 0xFFFF),
    st.integers(0, 0xFFFFFFFF),
    st.binary(max_size=500),
)
def test_any_frame_round_trips(op: int, rid: int, handle: int, payload: bytes) -> None:
    assert decode_frame(encode_frame(op, rid, handle, payload)) == (1, op, rid, handle, payload)
