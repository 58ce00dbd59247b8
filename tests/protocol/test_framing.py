from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from exstill_sdk.protocol.constants import Opcode
from exstill_sdk.protocol.frame import encode_frame
from exstill_sdk.protocol.framing import MAX_ENCODED, Deframer, encode_stream_frame

frames_strategy = st.lists(st.binary(min_size=1, max_size=600), min_size=1, max_size=8)


@given(frames_strategy, st.randoms(use_true_random=False))
def test_any_chunking_yields_the_frames(frames: list[bytes], rnd: random.Random) -> None:
    stream = b"".join(encode_stream_frame(f) for f in frames)
    cuts = sorted(rnd.sample(range(1, len(stream)), min(len(stream) - 1, rnd.randint(0, 10))))
    deframer = Deframer()
    out: list[bytes] = []
    for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        out += deframer.feed(stream[a:b])
    assert out == frames
    assert deframer.dropped == 0


def test_encoded_frames_contain_no_zero_and_cost_two_bytes() -> None:
    frame = encode_frame(Opcode.COMMIT, 1, 0x100, bytes(6))
    encoded = encode_stream_frame(frame)
    assert encoded.index(0) == len(encoded) - 1
    assert len(encoded) == len(frame) + 2


@given(st.binary(max_size=200), frames_strategy)
def test_resynchronises_after_garbage(garbage: bytes, frames: list[bytes]) -> None:
    deframer = Deframer()
    # Garbage, then a delimiter (the receiver cannot know where garbage ends before one).
    deframer.feed(garbage + b"\x00")
    out: list[bytes] = []
    for f in frames:
        out += deframer.feed(encode_stream_frame(f))
    assert out == frames


def test_oversize_run_is_discarded_then_next_frame_read() -> None:
    deframer = Deframer()
    assert deframer.feed(b"\x07" * (MAX_ENCODED + 10)) == []
    assert deframer.feed(b"\x07" * 100 + b"\x00") == []
    assert deframer.dropped == 1
    good = encode_frame(Opcode.PING, 3, 0, b"ok")
    assert deframer.feed(encode_stream_frame(good)) == [good]


def test_undecodable_cobs_is_counted() -> None:
    deframer = Deframer()
    assert deframer.feed(b"\x05ab\x00") == []  # code byte promises more than follows
    assert deframer.dropped == 1
