"""tcp:// against a real socket server."""

from __future__ import annotations

import socket
import time

import pytest
from exstill_firmware.emulator import TcpCardServer

from exstill_sdk import LinkTimeoutError, TransportError, open_card
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
