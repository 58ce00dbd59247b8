"""The client API on the in-process emulator and over real TCP sockets."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from exstill_firmware.emulator import TcpCardServer

from exstill_sdk import (
    CardFullError,
    ContextFullError,
    ExstillError,
    InvalidArgumentError,
    LinkTimeoutError,
    StreamHandleError,
    UnknownModelError,
    WireMode,
    open_card,
)
from exstill_sdk.protocol.constants import Features
from exstill_sdk.protocol.drafts import Verdict


def test_info_and_stats() -> None:
    with open_card("emu://?streams=5&context=2048&max_k=8") as card:
        info = card.info()
        assert (info.slots, info.context, info.max_k, info.protocol_version) == (5, 2048, 8, 1)
        assert info.engines == ("lookup",) and WireMode.DIST in info.wire_modes
        assert info.features & Features.PREFETCH
        assert card.stats()["streams_open"] == 0
        assert card.ping(b"abc") > 0


def test_stream_lifecycle() -> None:
    with open_card("emu://") as card, card.open_stream() as s:
        prompt = [7, 8, 9, 10] * 3000  # 12,000 tokens: several PREFILL frames
        assert s.prefill(prompt) == 12000 == s.length
        d = s.draft(5)
        assert d.tokens == (7, 8, 9, 10, 7) and not d.prefetch_hit
        d = s.commit(Verdict(5, 8), 3)
        assert s.length == 12006 and d.tokens == (9, 10, 7)
        assert s.rollback(11999) == 11999 == s.length
        assert s.draft(2).tokens == (10, 7)
        assert card.stats()["rounds"] == 1
    with open_card("emu://") as card:
        s = card.open_stream()
        s.close()
        s.close()  # twice is fine
        with pytest.raises(ExstillError, match="closed"):
            s.draft(1)


def test_client_side_checks_do_not_touch_the_card() -> None:
    with open_card("emu://?max_k=8&context=64") as card, card.open_stream() as s:
        s.prefill([1, 2, 3, 1, 2])
        d = s.draft(3)
        with pytest.raises(InvalidArgumentError):
            s.commit(Verdict(len(d.tokens) + 1, 5), 3)
        with pytest.raises(InvalidArgumentError):
            s.commit(Verdict(0, -1), 3)
        with pytest.raises(InvalidArgumentError):
            s.draft(300)
        with pytest.raises(InvalidArgumentError):
            s.rollback(99)
        with pytest.raises(InvalidArgumentError):
            s.prefill([1] * 100)
        # and the card-side checks arrive as the same typed errors
        with pytest.raises(InvalidArgumentError) as info:
            s.draft(9)
        assert info.value.code == 0x08
        # nothing refused above reached the stream: this round is the first, from length 5
        assert s.commit(Verdict(len(d.tokens), 3), 2).tokens == (1, 2)  # after 1 2 3 1 2 [3 1 2] 3
        assert s.length == 9 and card.stats()["rounds"] == 1


def test_card_errors_are_typed() -> None:
    with open_card("emu://?streams=2&context=32") as card:
        with pytest.raises(UnknownModelError, match="lookup"):
            card.open_stream("missing")
        with pytest.raises(UnknownModelError):
            card.open_stream(target="llama")
        a, b = card.open_stream(), card.open_stream()
        with pytest.raises(CardFullError, match="close"):
            card.open_stream()
        a.prefill([1] * 30)
        d = a.draft(4)
        with pytest.raises(ContextFullError, match="32-token slot"):
            a.commit(Verdict(len(d.tokens), 1), 4)  # 30 + 4 + 1 > 32
        assert a.commit(Verdict(1, 1), 0).tokens == ()  # the stream is intact: 32 tokens now
        a.close()
        card.open_stream()
        b.close()


def test_foreign_handle_is_refused_over_tcp(tcp_server: TcpCardServer) -> None:
    with open_card(tcp_server.url) as alice, open_card(tcp_server.url) as mallory:
        s = alice.open_stream()
        s.prefill([4, 5, 6, 4, 5])
        stolen = mallory.open_stream()
        stolen.handle = s.handle
        with pytest.raises(StreamHandleError, match="not open on this connection"):
            stolen.draft(2)
        with pytest.raises(StreamHandleError):
            stolen.close()
        assert s.draft(2).tokens == (6, 4)


def test_disconnect_frees_streams(tcp_server: TcpCardServer) -> None:
    card = open_card(tcp_server.url)
    for _ in range(12):
        card.open_stream()
    card.close()
    deadline = time.monotonic() + 5
    with open_card(tcp_server.url) as other:
        while other.stats()["streams_open"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert other.stats()["streams_open"] == 0
        other.open_stream()


def test_many_threads_pipeline_over_one_link(tcp_server: TcpCardServer) -> None:
    """12 threads, one stream each, share one TCP connection; every reply reaches its owner."""
    errors: list[BaseException] = []
    with open_card(tcp_server.url) as card:

        def worker(i: int) -> None:
            try:
                pattern = [100 * i + j for j in range(5)]
                with card.open_stream() as s:
                    s.prefill(pattern * 2)
                    d = s.draft(4)
                    for _ in range(200):
                        assert d.tokens == tuple(pattern[: len(d.tokens)])
                        assert len(d.tokens) == 4
                        d = s.commit(Verdict(4, pattern[4]), 4)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert card.stats()["rounds"] == 12 * 200
        assert card.dropped_replies == 0


def test_late_reply_is_dropped_and_stream_resyncs(tcp_server: TcpCardServer) -> None:
    with open_card(tcp_server.url) as card, card.open_stream() as s:
        s.prefill([1, 2, 3, 4, 1, 2, 3, 4, 1])
        d = s.draft(3)
        with pytest.raises(LinkTimeoutError):
            s.commit(
                Verdict(3, 1), 3, timeout=1e-6
            )  # the card applies it; the reply comes too late
        # The next call resynchronises (rollback to the host's length) and works.
        d = s.draft(3)
        assert s.length == 9 and d.tokens == (2, 3, 4)
        assert card.dropped_replies == 1
        assert s.commit(Verdict(3, 1), 3).tokens == (2, 3, 4)


class _DuplicatingProxy:
    """A real TCP proxy that sends every byte from the card to the client twice."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.upstream = upstream
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        client, _ = self.listener.accept()
        card = socket.create_connection(self.upstream)

        def pump(src: socket.socket, dst: socket.socket, copies: int) -> None:
            while data := src.recv(65536):
                for _ in range(copies):
                    dst.sendall(data)
            dst.close()

        threading.Thread(target=pump, args=(client, card, 1), daemon=True).start()
        pump(card, client, 2)


def test_duplicate_replies_are_dropped(tcp_server: TcpCardServer) -> None:
    proxy = _DuplicatingProxy((tcp_server.host, tcp_server.port))
    with open_card(proxy.url) as card, card.open_stream() as s:
        pattern = [9, 8, 7]
        s.prefill(pattern * 2)
        d = s.draft(3)
        for _ in range(20):
            assert d.tokens == tuple(pattern[(s.length + i) % 3] for i in range(3))
            d = s.commit(Verdict(3, pattern[s.length % 3]), 3)
        assert card.dropped_replies >= 20


def test_bad_urls() -> None:
    from exstill_sdk import BadURLError, DeviceNotFoundError

    for url in ["nope://x", "emu://?streams=x", "emu://?bogus=1", "emu://host", "tcp://h", "x"]:
        with pytest.raises(BadURLError):
            open_card(url)
    with pytest.raises(UnknownModelError):
        open_card("emu://?engine=magic")
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    with pytest.raises(DeviceNotFoundError, match="exstill-emu"):
        open_card(f"tcp://127.0.0.1:{port}")


def test_trace_logs_decoded_frames(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("DEBUG", logger="exstill_sdk.trace")
    with open_card("emu://", trace=True) as card, card.open_stream() as s:
        s.prefill([1, 2, 1])
    text = caplog.text
    assert "'op': 'HELLO'" in text and "'op': 'PREFILL reply'" in text and "'length': 3" in text


def test_pipelined_commits_match_one_at_a_time(tcp_server: TcpCardServer) -> None:
    """send_commit for several streams, then receive_commit in another order: the drafts are
    those of commit() one stream at a time."""
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 5, 6, 5, 6], [9, 8, 7, 9, 8, 7, 9]]

    def run(card, pipelined: bool) -> list[tuple[int, ...]]:
        streams = [card.open_stream("lookup") for _ in prompts]
        drafts = []
        for s, p in zip(streams, prompts, strict=True):
            s.prefill(p)
            drafts.append(s.draft(4).tokens)
        out = []
        lengths = [len(p) for p in prompts]
        for _ in range(5):
            accepted = [min(2, len(d)) for d in drafts]
            lengths = [n + a + 1 for n, a in zip(lengths, accepted, strict=True)]
            bonus = [d[a] + 1 if a < len(d) else 4 for d, a in zip(drafts, accepted, strict=True)]
            if pipelined:
                rids = [
                    s.send_commit(Verdict(a, b), 4)
                    for s, a, b in zip(streams, accepted, bonus, strict=True)
                ]
                got = {}
                for i in reversed(range(len(streams))):
                    got[i] = (
                        streams[i].receive_commit(rids[i], Verdict(accepted[i], bonus[i])).tokens
                    )
                drafts = [got[i] for i in range(len(streams))]
            else:
                drafts = [
                    s.commit(Verdict(a, b), 4).tokens
                    for s, a, b in zip(streams, accepted, bonus, strict=True)
                ]
            out.extend(drafts)
        assert [s.length for s in streams] == lengths
        for s in streams:
            s.close()
        return out

    with open_card(f"tcp://127.0.0.1:{tcp_server.port}") as card:
        pipelined = run(card, True)
    with open_card("emu://") as card:
        assert run(card, False) == pipelined


def test_prefill_without_waiting_then_draft_over_tcp(tcp_server: TcpCardServer) -> None:
    with open_card(tcp_server.url) as card:
        s, other = card.open_stream(), card.open_stream()
        s.prefill([1, 2, 3])
        rid = s.send_prefill([4, 5, 6, 1, 2, 3])
        other.prefill([9, 9])  # another request answered meanwhile: the reply waits its turn
        assert s.length == 3  # not known until the reply is read
        assert s.receive_prefill(rid) == 9 == s.length
        assert s.draft(3).tokens == (4, 5, 6)  # the card drafts after every token sent
        with pytest.raises(InvalidArgumentError, match="one frame"):
            s.send_prefill([1] * (card.info().max_payload // 4 + 1))


def test_one_threads_held_rounds_do_not_hold_another_threads_requests(
    tcp_server: TcpCardServer,
) -> None:
    with open_card(tcp_server.url) as card:
        s = card.open_stream()
        s.prefill([1, 2, 3, 1, 2])
        draft = s.draft(2)
        assert draft.tokens == (3, 1)
        verdict = Verdict(2, 2)  # both accepted, then 2: the text goes on repeating
        answers: list[float] = []
        with card.sent_together():
            rid = s.send_commit(verdict, 2)  # held back until the block ends
            other = threading.Thread(target=lambda: answers.append(card.ping(b"x")))
            other.start()
            other.join(10)
            assert answers, "the other thread's request waited for this thread's block"
        assert s.receive_commit(rid, verdict).tokens == (3, 1)  # the held round went out after


def test_a_reopened_link_loses_what_the_old_one_awaited(tcp_server: TcpCardServer) -> None:
    from exstill_sdk import DeviceLostError
    from exstill_sdk.protocol.constants import Opcode
    from exstill_sdk.protocol.frame import pack_frame

    with open_card(tcp_server.url) as card:
        s = card.open_stream()
        s.prefill([1, 2, 3, 1, 2])
        rid = card.next_rid()
        card.send(pack_frame(Opcode.PING, rid, 0, b""), rid)
        card.reconnect()
        # at once, not after a timeout: the reply went to the old link
        with pytest.raises(DeviceLostError, match="reopened"):
            card.receive(rid, Opcode.PING, time.monotonic() + 60)
        # a stream of the old session is lost (whoever holds it recovers as from a lost card)
        with pytest.raises(DeviceLostError, match="card was lost"):
            s.draft(1)
        assert card.next_rid() != rid  # ids go on: no reply can be taken for another's
