from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from exstill_sdk import ProtocolError
from exstill_sdk.protocol import messages as m

from .strategies import (
    commits,
    draft_replies,
    errors,
    hello_replies,
    hello_requests,
    open_replies,
    open_requests,
    stats,
    token_lists,
)

CODECS = [
    (hello_requests, m.encode_hello_request, m.decode_hello_request),
    (hello_replies, m.encode_hello_reply, m.decode_hello_reply),
    (stats, m.encode_stats_reply, m.decode_stats_reply),
    (open_replies, m.encode_open_reply, m.decode_open_reply),
    (commits, m.encode_commit_request, m.decode_commit_request),
    (draft_replies(), m.encode_draft_reply, m.decode_draft_reply),
    (errors, m.encode_error_reply, m.decode_error_reply),
    (token_lists.map(tuple), m.encode_tokens, m.decode_tokens),
    (st.integers(0, 2**32 - 1), m.encode_u32, m.decode_u32),
    (st.integers(0, 255), m.encode_u8, m.decode_u8),
]
DECODERS = [c[2] for c in CODECS] + [m.decode_open_request]


@pytest.mark.parametrize("strategy,encode,decode", CODECS)
def test_round_trip(strategy, encode, decode) -> None:
    @given(strategy)
    def check(message) -> None:
        assert decode(encode(message)) == message

    check()


@given(open_requests)
def test_open_request_round_trip(req: m.OpenRequest) -> None:
    back = m.decode_open_request(m.encode_open_request(req))
    # floats travel as float32: compare after the same rounding
    assert back == m.decode_open_request(m.encode_open_request(back))
    assert (back.kind, back.name, back.seed, back.top_k) == (
        req.kind,
        req.name,
        req.seed,
        req.top_k,
    )


@pytest.mark.parametrize("decode", DECODERS)
def test_decoders_raise_only_protocol_error(decode) -> None:
    @given(st.binary(max_size=200))
    def fuzz(data: bytes) -> None:
        with contextlib.suppress(ProtocolError):
            decode(data)

    fuzz()


@given(draft_replies(), st.data())
def test_mutated_draft_replies_raise_only_protocol_error(reply: m.Draft, data) -> None:
    raw = bytearray(m.encode_draft_reply(reply))
    if raw:
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] ^= data.draw(st.integers(1, 255))
    cut = data.draw(st.integers(0, len(raw)))
    with contextlib.suppress(ProtocolError):
        m.decode_draft_reply(bytes(raw[:cut]))


def test_greedy_round_payloads_are_small() -> None:
    assert len(m.encode_commit_request(m.CommitRequest(6, 50000, 6))) == 6
    assert len(m.encode_draft_reply(m.Draft(tuple(range(6))))) == 26


def test_encoders_refuse_out_of_range_values() -> None:
    with pytest.raises(ProtocolError):
        m.encode_commit_request(m.CommitRequest(256, 1, 1))
    with pytest.raises(ProtocolError):
        m.encode_tokens([2**32])
    with pytest.raises(ProtocolError):
        m.encode_open_request(m.OpenRequest(0, "x" * 65))
    with pytest.raises(ProtocolError):
        m.encode_dist(m.Distribution((), ()))
