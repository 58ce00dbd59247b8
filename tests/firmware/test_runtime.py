"""The card runtime, frame in and frame out: every kind of bad input, isolation between
clients, telemetry and prefetch."""

from __future__ import annotations

import struct

import pytest
from exstill_firmware import CardRuntime
from exstill_firmware.engines import ContextState, DraftEngine, LookupEngine, Proposal, Sampling
from hypothesis import given
from hypothesis import strategies as st

from exstill_sdk.protocol import messages as m
from exstill_sdk.protocol.constants import RESPONSE_BIT, ErrorCode, ModelKind, Opcode, WireMode
from exstill_sdk.protocol.frame import decode_frame, encode_frame


class Client:
    """Speaks raw frames to a runtime as one session."""

    def __init__(self, runtime: CardRuntime, hello: bool = True) -> None:
        self.runtime = runtime
        self.session = runtime.open_session("test")
        self.rid = 0
        if hello:
            self.ok(Opcode.HELLO, m.encode_hello_request(m.HelloRequest(1, 1, "test")))

    def send(self, op: int, payload: bytes = b"", handle: int = 0):
        self.rid = (self.rid + 1) & 0xFFFF
        reply = self.runtime.handle(self.session, encode_frame(op, self.rid, handle, payload))
        assert reply is not None
        frame = decode_frame(reply)
        assert frame.request_id == self.rid
        return frame

    def ok(self, op: int, payload: bytes = b"", handle: int = 0) -> bytes:
        frame = self.send(op, payload, handle)
        assert frame.opcode == op | RESPONSE_BIT, m.decode_error_reply(frame.payload)
        return frame.payload

    def error(self, op: int, payload: bytes = b"", handle: int = 0) -> int:
        frame = self.send(op, payload, handle)
        assert frame.opcode == Opcode.ERROR
        return m.decode_error_reply(frame.payload).code

    def open(self, name: str = "lookup", **kw) -> int:
        req = m.OpenRequest(kind=kw.pop("kind", ModelKind.ENGINE), name=name, **kw)
        return m.decode_open_reply(self.ok(Opcode.OPEN, m.encode_open_request(req))).handle

    def prefill(self, h: int, tokens: list[int]) -> int:
        return m.decode_u32(self.ok(Opcode.PREFILL, m.encode_tokens(tokens), h))

    def draft(self, h: int, k: int) -> m.Draft:
        return m.decode_draft_reply(self.ok(Opcode.DRAFT, bytes([k]), h))

    def commit(self, h: int, accepted: int, bonus: int, k: int) -> m.Draft:
        payload = m.encode_commit_request(m.CommitRequest(accepted, bonus, k))
        return m.decode_draft_reply(self.ok(Opcode.COMMIT, payload, h))


@pytest.fixture
def runtime():
    rt = CardRuntime(slots=4, context=64, max_k=8, background_prefetch=False)
    yield rt
    rt.shutdown()


def test_full_round(runtime: CardRuntime) -> None:
    c = Client(runtime)
    h = c.open()
    assert c.prefill(h, [1, 2, 3, 4, 1, 2]) == 6
    assert c.draft(h, 4).tokens == (3, 4, 1, 2)
    reply = c.commit(h, 2, 9, 3)  # accepted 3, 4; target said 9
    assert reply.tokens == ()  # "4 9" never seen before
    stats = m.decode_stats_reply(c.ok(Opcode.STATS))
    assert stats["rounds"] == 1 and stats["accepted_tokens"] == 2 and stats["draft_tokens"] == 4


def test_dropped_frames_get_no_reply(runtime: CardRuntime) -> None:
    c = Client(runtime)
    good = encode_frame(Opcode.PING, 1, 0, b"x")
    for bad in (good[:-1], good[:4], good[:-1] + bytes([good[-1] ^ 1]), good + b"\x00", b""):
        assert runtime.handle(c.session, bad) is None
    assert runtime.handle(c.session, bytes(40000)) is None  # oversize
    assert runtime.telemetry.frames_dropped == 6
    assert c.ok(Opcode.PING, b"alive") == b"alive"


def test_typed_errors(runtime: CardRuntime) -> None:
    fresh = Client(runtime, hello=False)
    assert fresh.error(Opcode.OPEN, b"") == ErrorCode.HANDSHAKE_REQUIRED
    assert fresh.error(Opcode.HELLO, m.encode_hello_request(m.HelloRequest(2, 3))) == (
        ErrorCode.UNSUPPORTED_VERSION
    )
    c = Client(runtime)
    assert c.error(0x42) == ErrorCode.UNKNOWN_OPCODE
    reply = runtime.handle(c.session, encode_frame(Opcode.PING, 5, 0, b"", version=2))
    assert m.decode_error_reply(decode_frame(reply).payload).code == ErrorCode.UNSUPPORTED_VERSION
    req = m.OpenRequest(ModelKind.ENGINE, "nope")
    assert c.error(Opcode.OPEN, m.encode_open_request(req)) == ErrorCode.UNKNOWN_MODEL
    req = m.OpenRequest(ModelKind.TARGET, "lookup")
    assert c.error(Opcode.OPEN, m.encode_open_request(req)) == ErrorCode.UNKNOWN_MODEL
    req = m.OpenRequest(ModelKind.ENGINE, "lookup", max_k=9)
    assert c.error(Opcode.OPEN, m.encode_open_request(req)) == ErrorCode.K_OUT_OF_RANGE
    req = m.OpenRequest(ModelKind.ENGINE, "lookup", top_p=0.0)
    assert c.error(Opcode.OPEN, m.encode_open_request(req)) == ErrorCode.BAD_ARGUMENT
    req = m.OpenRequest(ModelKind.ENGINE, "lookup", temperature=-1.0)
    assert c.error(Opcode.OPEN, m.encode_open_request(req)) == ErrorCode.BAD_ARGUMENT
    assert c.error(Opcode.OPEN, b"\x00\x01") == ErrorCode.BAD_PAYLOAD
    h = c.open()
    assert c.error(Opcode.DRAFT, bytes([9]), h) == ErrorCode.K_OUT_OF_RANGE
    assert c.error(Opcode.DRAFT, b"", h) == ErrorCode.BAD_PAYLOAD
    assert c.error(Opcode.PREFILL, b"\x01\x02\x03", h) == ErrorCode.BAD_PAYLOAD
    assert c.error(Opcode.PREFILL, m.encode_tokens([1] * 65), h) == ErrorCode.CONTEXT_FULL
    c.prefill(h, [1, 2, 3])
    assert c.error(Opcode.ROLLBACK, m.encode_u32(4), h) == ErrorCode.BAD_ARGUMENT
    commit = m.encode_commit_request(m.CommitRequest(1, 5, 2))
    assert c.error(Opcode.COMMIT, commit, h) == ErrorCode.BAD_ARGUMENT  # nothing drafted
    assert c.error(Opcode.COMMIT, commit[:5], h) == ErrorCode.BAD_PAYLOAD
    assert c.error(Opcode.DRAFT, bytes([2]), h ^ 0x100) == ErrorCode.BAD_HANDLE
    stats = m.decode_stats_reply(c.ok(Opcode.STATS))
    assert stats["errors.bad_handle"] == 1 and stats["errors.context_full"] == 1
    # None of that changed the stream.
    assert c.prefill(h, []) == 3


def test_context_full_on_commit_leaves_the_stream_intact(runtime: CardRuntime) -> None:
    c = Client(runtime)
    h = c.open()
    c.prefill(h, [1, 2] * 31)  # 62 of 64
    draft = c.draft(h, 4)
    assert len(draft.tokens) == 4
    commit = m.encode_commit_request(m.CommitRequest(4, 1, 4))
    assert c.error(Opcode.COMMIT, commit, h) == ErrorCode.CONTEXT_FULL
    assert c.commit(h, 1, 2, 1).tokens == (1,)
    assert c.prefill(h, []) == 64


def test_card_full_and_slot_reuse(runtime: CardRuntime) -> None:
    c = Client(runtime)
    handles = [c.open() for _ in range(4)]
    assert len(set(handles)) == 4
    assert c.error(Opcode.OPEN, m.encode_open_request(m.OpenRequest(0, "lookup"))) == (
        ErrorCode.CARD_FULL
    )
    c.ok(Opcode.CLOSE, b"", handles[0])
    assert c.error(Opcode.CLOSE, b"", handles[0]) == ErrorCode.BAD_HANDLE  # closed stays closed
    new = c.open()
    assert new & 0xFF == handles[0] & 0xFF and new != handles[0]  # same slot, fresh nonce
    assert c.error(Opcode.DRAFT, b"\x01", handles[0]) == ErrorCode.BAD_HANDLE


def test_handles_are_private_to_their_session(runtime: CardRuntime) -> None:
    alice, mallory = Client(runtime), Client(runtime)
    h = alice.open()
    alice.prefill(h, [5, 6, 7, 5, 6])
    for op, payload in [
        (Opcode.DRAFT, b"\x02"),
        (Opcode.PREFILL, m.encode_tokens([1])),
        (Opcode.ROLLBACK, m.encode_u32(0)),
        (Opcode.CLOSE, b""),
    ]:
        assert mallory.error(op, payload, h) == ErrorCode.BAD_HANDLE
    assert alice.draft(h, 2).tokens == (7, 5)
    runtime.close_session(alice.session)
    assert runtime.streams.open_count == 0


class ExplodingEngine(DraftEngine):
    """A faulty engine: the card must contain its failure to the stream that used it."""

    name = "exploding"

    def open_state(
        self, capacity: int, sampling: Sampling, long_context: bool = False
    ) -> ContextState:
        class State(ContextState):
            def _extended(self, start: int) -> None:
                pass

            def _truncating(self, length: int) -> None:
                pass

            def propose(self, k: int, branch: bytes = b"") -> Proposal:
                raise RuntimeError("engine fault")

        return State()


def test_engine_fault_is_an_internal_error_and_others_keep_working() -> None:
    rt = CardRuntime(slots=4, context=64, engines=[LookupEngine(), ExplodingEngine()])
    try:
        c = Client(rt)
        bad = c.open("exploding")
        good = c.open("lookup")
        c.prefill(good, [1, 2, 3, 1, 2])
        assert c.error(Opcode.DRAFT, b"\x02", bad) == ErrorCode.INTERNAL
        assert c.draft(good, 2).tokens == (3, 1)
    finally:
        rt.shutdown()


def test_dist_wire_mode_sends_one_hot_for_deterministic_drafts(runtime: CardRuntime) -> None:
    c = Client(runtime)
    h = c.open(wire_mode=WireMode.DIST, temperature=0.8, seed=3)
    c.prefill(h, [7, 8, 9, 7, 8])
    reply = c.draft(h, 3)
    assert reply.tokens == (9, 7, 8)
    assert reply.dists == tuple(m.Distribution((t,), (1,)) for t in (9, 7, 8))


def test_prefetch_hit_serves_the_same_draft_as_without() -> None:
    on = CardRuntime(slots=2, context=4096, background_prefetch=False)
    off = CardRuntime(slots=2, context=4096, prefetch=False)
    try:
        a, b = Client(on), Client(off)
        ha, hb = a.open(), b.open()
        text = [3, 1, 4, 1, 5, 9, 2, 6] * 4
        a.prefill(ha, text)
        b.prefill(hb, text)
        da, db = a.draft(ha, 5), b.draft(hb, 5)
        on.run_prefetch()  # the card idles while the host verifies
        assert da.tokens == db.tokens == (3, 1, 4, 1, 5)
        # The target accepts everything and its bonus is the text's next token: a hit.
        ra, rb = a.commit(ha, 5, 9, 5), b.commit(hb, 5, 9, 5)
        assert ra.prefetch_hit and not rb.prefetch_hit
        assert ra.tokens == rb.tokens
        on.run_prefetch()
        # A different bonus: a miss, and still the right draft.
        ra, rb = a.commit(ha, 5, 7, 4), b.commit(hb, 5, 7, 4)
        assert not ra.prefetch_hit and ra.tokens == rb.tokens
        stats = m.decode_stats_reply(a.ok(Opcode.STATS))
        assert stats["prefetch_hits"] == 1 and stats["prefetch_misses"] == 1
    finally:
        on.shutdown()
        off.shutdown()


def test_prefetch_never_changes_what_is_drafted() -> None:
    """Whatever the host commits, with prefetch or without, the card answers with identical
    drafts; and the rounds include prefetch hits, so the hit path is what was compared."""
    hits = []

    @given(
        st.lists(
            st.tuples(
                st.integers(0, 6), st.one_of(st.none(), st.integers(0, 3)), st.integers(0, 6)
            ),
            max_size=30,
        )
    )
    def check(rounds: list[tuple[int, int | None, int]]) -> None:
        on = CardRuntime(slots=1, context=4096, background_prefetch=False)
        off = CardRuntime(slots=1, context=4096, prefetch=False)
        try:
            a, b = Client(on), Client(off)
            ha, hb = a.open(), b.open()
            text = [0, 1, 2, 3, 0, 1, 2, 3, 0]
            a.prefill(ha, text)
            b.prefill(hb, text)
            da, db = a.draft(ha, 6), b.draft(hb, 6)
            for accept, bonus, k in rounds:
                assert da.tokens == db.tokens
                on.run_prefetch()  # the card drafts ahead while the host verifies
                n = min(accept, len(da.tokens))
                text += da.tokens[:n]
                if bonus is None:  # the text's own next token: what a prefetch guesses
                    bonus = (text[-1] + 1) % 4
                text.append(bonus)
                da, db = a.commit(ha, n, bonus, k), b.commit(hb, n, bonus, k)
                hits.append(da.prefetch_hit)
            assert da.tokens == db.tokens
        finally:
            on.shutdown()
            off.shutdown()

    check()
    assert any(hits) and not all(hits)


@given(st.binary(max_size=64), st.integers(0, 255), st.integers(0, 2**32 - 1))
def test_random_payloads_never_crash(payload: bytes, op: int, handle: int) -> None:
    rt = CardRuntime(slots=2, context=64, prefetch=False)
    c = Client(rt)
    h = c.open()
    c.prefill(h, [1, 2, 3, 1, 2])
    frame = decode_frame(rt.handle(c.session, encode_frame(op, 77, handle, payload)))
    assert frame.request_id == 77
    assert c.draft(h, 2).tokens == (3, 1)


def test_streams_and_context_are_configurable() -> None:
    rt = CardRuntime(slots=3, context=128, prefetch=False)
    c = Client(rt)
    info = m.decode_hello_reply(c.ok(Opcode.HELLO, m.encode_hello_request(m.HelloRequest(1, 1))))
    assert (info.slots, info.context, info.engines) == (3, 128, ("lookup",))
    with pytest.raises(ValueError):
        CardRuntime(slots=0)


def test_handles_carry_random_nonces(runtime: CardRuntime) -> None:
    c = Client(runtime)
    seen = set()
    for _ in range(50):
        h = c.open()
        seen.add(h >> 8)
        c.ok(Opcode.CLOSE, b"", h)
    assert len(seen) > 45  # 24 random bits each


def test_greedy_round_frame_sizes(runtime: CardRuntime) -> None:
    """A greedy K=6 round is 22 + 42 bytes of frames (68 with COBS framing)."""
    c = Client(runtime)
    h = c.open()
    c.prefill(h, [1, 2, 3, 4, 5, 6, 7] * 3)
    c.draft(h, 6)
    request = encode_frame(Opcode.COMMIT, 1, h, m.encode_commit_request(m.CommitRequest(6, 7, 6)))
    reply = runtime.handle(c.session, request)
    assert len(request) == 22 and len(reply) == 42
    assert struct.unpack_from("<6I", reply, 14) == (1, 2, 3, 4, 5, 6)


def test_rounds_sent_together_draft_as_rounds_sent_alone() -> None:
    """COMMITs read together (handle_many) are answered with exactly the drafts that one at a
    time would give, misses drafted in one batch; a frame for a stream with a draft pending
    is served after it."""
    from exstill_firmware.emulator.loading import build_engines

    from exstill_sdk.demo import DRAFT_TARGET, demo_dir, held_out_prompts

    def card() -> tuple[CardRuntime, Client, list[int]]:
        engines = build_engines([], [str(demo_dir() / "draft.img")], 4, 256, threads=1)
        rt = CardRuntime(4, 256, engines, background_prefetch=False)
        c = Client(rt)
        handles = [c.open(DRAFT_TARGET, kind=ModelKind.TARGET) for _ in range(4)]
        for h, p in zip(handles, held_out_prompts(4, 20), strict=True):
            c.prefill(h, p)
            c.draft(h, 3)
        return rt, c, handles

    (together, a, ha), (alone, b, hb) = card(), card()
    for round_ in range(4):
        frames = []
        for i, h in enumerate(ha):  # mostly misses: a bonus the card did not guess
            payload = m.encode_commit_request(m.CommitRequest(i % 2, 7 + round_, 3 + i % 2))
            frames.append(encode_frame(Opcode.COMMIT, 100 + i, h, payload))
        frames.append(frames[0][:-1] + bytes([frames[0][-1] ^ 1]))  # a damaged frame: dropped
        frames.append(
            encode_frame(
                Opcode.COMMIT, 200, ha[0], m.encode_commit_request(m.CommitRequest(0, 5, 2))
            )
        )  # the same stream again: after its first round
        replies = together.handle_many(a.session, frames)
        assert len(replies) == 5
        for i, h in enumerate(hb):
            want = b.commit(h, i % 2, 7 + round_, 3 + i % 2)
            assert m.decode_draft_reply(decode_frame(replies[i]).payload) == want
        assert m.decode_draft_reply(decode_frame(replies[4]).payload) == b.commit(hb[0], 0, 5, 2)
    together.shutdown()
    alone.shutdown()
