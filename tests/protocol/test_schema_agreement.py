"""The construct schema (the formal definition) and the struct codec (what runs) agree on the
bytes of every message, both ways."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from exstill_sdk.protocol import messages as m
from exstill_sdk.protocol import schema
from exstill_sdk.protocol.constants import RESPONSE_BIT, TREE_ROOT, Opcode
from exstill_sdk.protocol.frame import decode_frame, encode_frame

from .strategies import (
    commit_tree_requests,
    commits,
    draft_replies,
    errors,
    hello_replies,
    hello_requests,
    open_replies,
    open_requests,
    stats,
    token_lists,
    tree_replies,
    tree_requests,
)


def _hello_reply_dict(r: m.HelloReply) -> dict:
    d = {k: getattr(r, k) for k in r.__dataclass_fields__}
    d["engines"] = list(r.engines)
    d["targets"] = [
        {"name": t.name, "vocab_size": t.vocab_size, "tokenizer_sha256": t.tokenizer_sha256}
        for t in r.targets
    ]
    return d


def _draft_dict(r: m.Draft) -> dict:
    return {
        "flags": {
            "reserved": 0,
            "lookup": r.lookup,
            "has_dist": r.dists is not None,
            "prefetch_hit": r.prefetch_hit,
        },
        "count": len(r.tokens),
        "tokens": list(r.tokens),
        "dists": None if r.dists is None else [_dist_dict(d) for d in r.dists],
    }


def _dist_dict(d: m.Distribution) -> dict:
    return {"n": len(d.tokens), "tokens": list(d.tokens), "weights": list(d.weights)}


def _tree_dict(r: m.Draft) -> dict:
    parents = r.parents if r.parents is not None else range(-1, len(r.tokens) - 1)
    return {
        "flags": {
            "reserved": 0,
            "lookup": r.lookup,
            "has_dist": r.dists is not None,
            "prefetch_hit": r.prefetch_hit,
        },
        "count": len(r.tokens),
        "tokens": list(r.tokens),
        "parents": [TREE_ROOT if p < 0 else p for p in parents],
        "dists": None
        if r.dists is None
        else [
            _dist_dict(d) for d in {p: d for p, d in zip(parents, r.dists, strict=True)}.values()
        ],
    }


def _commit_tree_dict(c: m.CommitTreeRequest) -> dict:
    return {
        "bonus": c.bonus,
        "next_nodes": c.next.nodes,
        "next_top_k": c.next.top_k,
        "next_depth": c.next.depth,
        "length": len(c.path),
        "path": list(c.path),
    }


def _plain(value):
    """A construct parse result as plain Python, for comparison."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if not k.startswith("_")}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


CASES = [
    (
        hello_requests,
        m.encode_hello_request,
        schema.HELLO_REQUEST,
        lambda r: {"min_version": r.min_version, "max_version": r.max_version, "client": r.client},
    ),
    (hello_replies, m.encode_hello_reply, schema.HELLO_REPLY, _hello_reply_dict),
    (
        stats,
        m.encode_stats_reply,
        schema.STATS_REPLY,
        lambda s: {"counters": [{"name": k, "value": v} for k, v in s.items()]},
    ),
    (
        open_replies,
        m.encode_open_reply,
        schema.OPEN_REPLY,
        lambda r: {"handle": r.handle, "context": r.context, "max_k": r.max_k},
    ),
    (
        commits,
        m.encode_commit_request,
        schema.COMMIT_REQUEST,
        lambda c: {"accepted": c.accepted, "next_k": c.next_k, "bonus": c.bonus},
    ),
    (draft_replies(), m.encode_draft_reply, schema.DRAFT_REPLY, _draft_dict),
    (
        errors,
        m.encode_error_reply,
        schema.ERROR_REPLY,
        lambda e: {"code": e.code, "message": e.message},
    ),
    (token_lists, m.encode_tokens, schema.TOKENS, lambda t: {"tokens": list(t)}),
    (st.integers(0, 2**32 - 1), m.encode_u32, schema.LENGTH, lambda n: {"length": n}),
    (st.integers(0, 255), m.encode_u8, schema.DRAFT_REQUEST, lambda k: {"k": k}),
    (tree_replies(), m.encode_tree_reply, schema.TREE_REPLY, _tree_dict),
    (
        tree_requests,
        m.encode_tree_request,
        schema.TREE_REQUEST,
        lambda t: {"nodes": t.nodes, "top_k": t.top_k, "depth": t.depth},
    ),
    (
        commit_tree_requests,
        m.encode_commit_tree_request,
        schema.COMMIT_TREE_REQUEST,
        _commit_tree_dict,
    ),
]


@pytest.mark.parametrize("strategy,encode,formal,as_dict", CASES)
def test_struct_and_construct_agree(strategy, encode, formal, as_dict) -> None:
    @given(strategy)
    def check(message) -> None:
        raw = encode(message)
        assert formal.build(as_dict(message)) == raw
        assert _plain(formal.parse(raw)) == _plain(as_dict(message))

    check()


@given(open_requests)
def test_open_request_agrees(req: m.OpenRequest) -> None:
    raw = m.encode_open_request(req)
    parsed = schema.OPEN_REQUEST.parse(raw)
    assert schema.OPEN_REQUEST.build(parsed) == raw
    assert m.decode_open_request(raw) == m.OpenRequest(
        parsed.kind,
        parsed.name,
        parsed.wire_mode,
        parsed.max_k,
        parsed.top_k,
        parsed.flags,
        parsed.temperature,
        parsed.top_p,
        parsed.seed,
    )


@given(
    st.integers(0, 255), st.integers(0, 0xFFFF), st.integers(0, 2**32 - 1), st.binary(max_size=64)
)
def test_frames_agree(op: int, rid: int, handle: int, payload: bytes) -> None:
    raw = encode_frame(op, rid, handle, payload)
    parsed = schema.FRAME.parse(raw)
    assert (parsed.header.opcode, parsed.header.request_id, parsed.header.handle) == (
        op,
        rid,
        handle,
    )
    assert parsed.payload == payload
    built = schema.FRAME.build(
        {
            "header": {
                "version": 1,
                "opcode": op,
                "request_id": rid,
                "handle": handle,
                "length": len(payload),
            },
            "payload": payload,
        }
    )
    assert built == raw
    assert decode_frame(built).payload == payload


def test_describe_frame_names_fields() -> None:
    raw = encode_frame(
        Opcode.COMMIT, 9, 0x01020304, m.encode_commit_request(m.CommitRequest(3, 77, 6))
    )
    d = schema.describe_frame(raw)
    assert d["op"] == "COMMIT" and d["rid"] == 9 and d["bonus"] == 77 and d["accepted"] == 3
    reply = encode_frame(Opcode.COMMIT | RESPONSE_BIT, 9, 1, m.encode_draft_reply(m.Draft((5, 6))))
    assert schema.describe_frame(reply)["tokens"] == [5, 6]
    assert "error" in schema.describe_frame(b"\x01\x02")


ACCEPTANCE = [
    (m.decode_commit_request, schema.COMMIT_REQUEST),
    (m.decode_draft_reply, schema.DRAFT_REPLY),
    (m.decode_u8, schema.DRAFT_REQUEST),
    (m.decode_u32, schema.LENGTH),
    (m.decode_tokens, schema.TOKENS),
    (m.decode_open_request, schema.OPEN_REQUEST),
    (m.decode_open_reply, schema.OPEN_REPLY),
    (m.decode_hello_request, schema.HELLO_REQUEST),
    (m.decode_hello_reply, schema.HELLO_REPLY),
    (m.decode_stats_reply, schema.STATS_REPLY),
]


@pytest.mark.parametrize("decode,formal", ACCEPTANCE)
def test_both_accept_and_reject_the_same_bytes(decode, formal) -> None:
    import construct

    from exstill_sdk import ProtocolError

    @given(st.one_of(st.binary(max_size=80), draft_replies().map(m.encode_draft_reply)), st.data())
    def check(raw: bytes, data) -> None:
        if raw and data.draw(st.booleans()):
            i = data.draw(st.integers(0, len(raw) - 1))
            raw = raw[:i] + bytes([data.draw(st.integers(0, 255))]) + raw[i + 1 :]
        try:
            decode(raw)
            struct_ok = True
        except ProtocolError:
            struct_ok = False
        try:
            formal.parse(raw)
            formal_ok = True
        except (construct.ConstructError, UnicodeDecodeError):
            formal_ok = False
        assert struct_ok == formal_ok

    check()


# ---------------------------------------------------------------- the bytes actually sent
# stream.py sends m.commit_frame / m.draft_frame and reads m.parse_draft_reply_frame; the
# runtime answers with m.draft_reply_payload. The formal schema must agree with those very
# builders, not with a test-only encoder.

u32s = st.integers(0, 2**32 - 1)


@given(st.integers(0, 0xFFFF), u32s, st.integers(0, 255), st.integers(0, 255), u32s)
def test_the_commit_frame_the_host_sends_is_the_formal_one(
    rid: int, handle: int, accepted: int, next_k: int, bonus: int
) -> None:
    raw = m.commit_frame(rid, handle, m.Verdict(accepted, bonus), next_k)
    payload = schema.COMMIT_REQUEST.build({"accepted": accepted, "next_k": next_k, "bonus": bonus})
    assert raw == encode_frame(Opcode.COMMIT, rid, handle, payload)
    parsed = schema.FRAME.parse(raw)
    assert (parsed.header.opcode, parsed.header.request_id, parsed.header.handle) == (
        Opcode.COMMIT,
        rid,
        handle,
    )


@given(st.integers(0, 0xFFFF), u32s, st.integers(0, 255))
def test_the_draft_frame_the_host_sends_is_the_formal_one(rid: int, handle: int, k: int) -> None:
    raw = m.draft_frame(rid, handle, k)
    assert raw == encode_frame(Opcode.DRAFT, rid, handle, schema.DRAFT_REQUEST.build({"k": k}))


@given(draft_replies())
def test_the_draft_reply_the_card_sends_is_the_formal_one(reply: m.Draft) -> None:
    draft = b"".join(t.to_bytes(4, "little") for t in reply.tokens)  # as the card keeps it
    raw = m.draft_reply_payload(reply.prefetch_hit, draft, reply.dists, reply.lookup)
    assert raw == schema.DRAFT_REPLY.build(_draft_dict(reply))
    frame = encode_frame(Opcode.COMMIT | RESPONSE_BIT, 1, 2, raw)
    assert m.parse_draft_reply_frame(frame) == reply  # what the host reads back


@given(st.lists(u32s, max_size=255), st.booleans(), st.booleans())
def test_a_one_hot_reply_is_the_reply_of_its_one_hot_distributions(
    tokens: list[int], hit: bool, lookup: bool
) -> None:
    draft = b"".join(t.to_bytes(4, "little") for t in tokens)
    dists = tuple(m.Distribution((t,), (1,)) for t in tokens)
    raw = m.one_hot_reply_payload(hit, draft, lookup)
    assert raw == m.draft_reply_payload(hit, draft, dists, lookup)
    assert raw == schema.DRAFT_REPLY.build(_draft_dict(m.Draft(tuple(tokens), hit, dists, lookup)))


@given(st.one_of(st.binary(max_size=80), draft_replies().map(m.encode_draft_reply)), st.data())
def test_the_hosts_draft_reader_accepts_what_the_schema_accepts(raw: bytes, data) -> None:
    import construct

    from exstill_sdk import ProtocolError

    if raw and data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw = raw[:i] + bytes([data.draw(st.integers(0, 255))]) + raw[i + 1 :]
    frame = encode_frame(Opcode.COMMIT | RESPONSE_BIT, 1, 2, raw)
    try:
        m.parse_draft_reply_frame(frame)
        host_ok = True
    except ProtocolError:
        host_ok = False
    try:
        schema.DRAFT_REPLY.parse(raw)
        formal_ok = True
    except construct.ConstructError:
        formal_ok = False
    assert host_ok == formal_ok


# ---------------------------------------------------------------- token trees

TREE_CODECS = [
    (m.decode_tree_reply, schema.TREE_REPLY, tree_replies().map(m.encode_tree_reply)),
    (m.decode_tree_request, schema.TREE_REQUEST, tree_requests.map(m.encode_tree_request)),
    (
        m.decode_commit_tree_request,
        schema.COMMIT_TREE_REQUEST,
        commit_tree_requests.map(m.encode_commit_tree_request),
    ),
]


@pytest.mark.parametrize("decode,formal,valid", TREE_CODECS)
def test_tree_messages_are_accepted_and_rejected_alike(decode, formal, valid) -> None:
    """Fuzzed tree messages (valid ones with a byte changed, cut or grown, and noise): the
    struct decoder raises ProtocolError exactly where the schema refuses the bytes."""
    import construct

    from exstill_sdk import ProtocolError

    @given(st.one_of(st.binary(max_size=120), valid), st.data())
    def check(raw: bytes, data) -> None:
        edit = data.draw(st.sampled_from(["none", "byte", "cut", "grow"]))
        if edit == "byte" and raw:
            i = data.draw(st.integers(0, len(raw) - 1))
            raw = raw[:i] + bytes([data.draw(st.integers(0, 255))]) + raw[i + 1 :]
        elif edit == "cut" and raw:
            raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
        elif edit == "grow":
            raw += data.draw(st.binary(min_size=1, max_size=4))
        try:
            decoded = decode(raw)
            struct_ok = True
        except ProtocolError:
            struct_ok = False
        try:
            formal.parse(raw)
            formal_ok = True
        except construct.ConstructError:
            formal_ok = False
        assert struct_ok == formal_ok
        if struct_ok and decode is m.decode_tree_reply:
            assert m.encode_tree_reply(decoded) == raw  # what is read is what was sent

    check()


@given(st.integers(0, 0xFFFF), u32s, tree_requests)
def test_the_tree_frames_the_host_sends_are_the_formal_ones(
    rid: int, handle: int, shape: m.TreeRequest
) -> None:
    raw = m.draft_tree_frame(rid, handle, shape)
    built = schema.TREE_REQUEST.build(
        {"nodes": shape.nodes, "top_k": shape.top_k, "depth": shape.depth}
    )
    assert raw == encode_frame(Opcode.DRAFT_TREE, rid, handle, built)
    path = tuple(range(shape.nodes % 65))
    raw = m.commit_tree_frame(rid, handle, m.Verdict(len(path), 7, path), shape)
    payload = schema.COMMIT_TREE_REQUEST.build(
        _commit_tree_dict(m.CommitTreeRequest(path, 7, shape))
    )
    assert raw == encode_frame(Opcode.COMMIT_TREE, rid, handle, payload)
    # a chain draft's verdict names its accepted prefix as the path
    assert m.commit_tree_frame(rid, handle, m.Verdict(len(path), 7), shape) == raw


@given(tree_replies())
def test_the_tree_reply_the_card_sends_is_the_formal_one(reply: m.Draft) -> None:
    draft = b"".join(t.to_bytes(4, "little") for t in reply.tokens)  # as the card keeps it
    parents = reply.parents if reply.parents is not None else range(-1, len(reply.tokens) - 1)
    wire = bytes(TREE_ROOT if p < 0 else p for p in parents)
    raw = m.tree_reply_payload(reply.prefetch_hit, draft, wire, reply.lookup, reply.dists)
    assert raw == schema.TREE_REPLY.build(_tree_dict(reply))
    assert m.decode_tree_reply(raw) == reply
