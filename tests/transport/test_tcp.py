"""tcp:// against a real socket server."""

from __future__ import annotations

import socket
import time

import pytest
from exstill_firmware.emulator import TcpCardServer

from exstill_sdk import LinkTimeoutError, TransportError, open_card
from exstill_sdk.errors import InvalidArgumentError
from exstill_sdk.protocol.constants import Opcode
from exstill_sdk.protocol.frame import encode_frame
from exstill_sdk.protocol.framing import encode_stream_frame
from exstill_sdk.transport import open_transport


def test_one_write_per_frame_and_replies(tcp_server: TcpCardServer) -> None:
    t = open_transport(tcp_server.url)
    try:
        frame = encode_frame(Opcode.PING, 42, 0, b"hello")
        t.send_frame(frame)
        reply = t.recv_frame(time.monotonic() + 5)
        assert reply[1] == Opcode.PING | 0x80 and reply[12:17] == b"hello"
    finally:
        t.close()


def test_a_polling_server_serves_rounds_as_a_sleeping_one() -> None:
    """A server that polls its sockets between reads (exstill-emu --poll-ms) answers what one
    that sleeps in recv answers: rounds with prefetch hits, two clients at once."""
    from exstill_firmware import CardRuntime

    from exstill_sdk.protocol.drafts import Verdict

    from ..helpers import served

    period = [3, 1, 4, 1, 5, 9, 2, 6]
    text = period * 8

    def following(n: int, count: int) -> list[int]:
        return [period[(n + i) % 8] for i in range(count)]

    runtime = CardRuntime(4, 1024, background_prefetch=False)
    with (
        served(runtime, poll_s=0.05) as server,
        open_card(server.url) as a,
        open_card(server.url) as b,
    ):
        streams = [card.open_stream("lookup") for card in (a, b)]
        for stream in streams:
            stream.prefill(text)
            assert list(stream.draft(4).tokens) == following(len(text), 4)
        n = len(text)
        for _ in range(5):  # every draft accepted, the bonus the text's next token
            bonus = following(n + 4, 1)[0]
            drafts = [s.commit(Verdict(4, bonus), 4) for s in streams]
            n += 5
            assert all(list(d.tokens) == following(n, 4) for d in drafts)
        assert a.stats()["prefetch_hits"] == 10  # one card: both clients' rounds
    with pytest.raises(InvalidArgumentError, match="poll"):
        TcpCardServer(CardRuntime(1, 64), poll_s=-1)


def test_corrupted_stream_resynchronises(tcp_server: TcpCardServer) -> None:
    """Garbage (with and without delimiters) before a valid frame: the frame is answered."""
    t = open_transport(tcp_server.url)
    try:
        t._write(b"\x13\x37garbage\x00\x05\x01\x02\x00" + b"\xff" * 500)
        t._write(b"\x00" + encode_stream_frame(encode_frame(Opcode.PING, 7, 0, b"ok")))
        reply = t.recv_frame(time.monotonic() + 5)
        assert reply[2] == 7 and reply[12:14] == b"ok"
    finally:
        t.close()


def test_client_disconnecting_mid_frame_does_not_disturb_others(
    tcp_server: TcpCardServer,
) -> None:
    with open_card(tcp_server.url) as card, card.open_stream() as s:
        s.prefill([1, 2, 3, 1, 2])
        rude = socket.create_connection((tcp_server.host, tcp_server.port))
        deadline = time.monotonic() + 10
        while tcp_server.connections < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert tcp_server.connections == 2  # the server serves the rude client
        rude.sendall(encode_stream_frame(encode_frame(Opcode.PING, 1, 0, b"x" * 100))[:50])
        rude.close()
        while tcp_server.connections > 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert tcp_server.connections == 1  # ... and has dropped it, half frame and all
        assert s.draft(2).tokens == (3, 1)
        assert card.stats()["streams_open"] == 1


def test_timeout_and_lost_link() -> None:
    listener = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    port = listener.getsockname()[1]
    t = open_transport(f"tcp://127.0.0.1:{port}")
    conn, _ = listener.accept()
    try:
        with pytest.raises(LinkTimeoutError):  # the type says it was the deadline
            t.recv_frame(time.monotonic() + 0.2)
        conn.close()
        with pytest.raises(TransportError, match="closed"):
            t.recv_frame(time.monotonic() + 2)
    finally:
        t.close()
        listener.close()


def test_handshake_timeout_is_a_typed_error() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        with pytest.raises(LinkTimeoutError):
            open_card(f"tcp://127.0.0.1:{listener.getsockname()[1]}", timeout=0.2)
    finally:
        listener.close()
