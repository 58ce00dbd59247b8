"""``tcp://HOST:PORT``: a card (or ``exstill-emu``) behind a TCP socket, COBS-framed."""

from __future__ import annotations

import socket
import struct
import time
from urllib.parse import SplitResult

from exstill_sdk.errors import (
    BadURLError,
    DeviceLostError,
    DeviceNotFoundError,
    LinkTimeoutError,
    TransportError,
)
from exstill_sdk.transport.bytestream import ByteStreamTransport

_TIMEVAL = struct.Struct("@ll")


class TcpTransport(ByteStreamTransport):
    scheme = "tcp"
    sniff_greeting = True

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # A blocking socket with a kernel receive timeout (SO_RCVTIMEO) reads with one system
        # call; a Python-level socket timeout adds a poll() before every read.
        sock.settimeout(None)
        self._sock = sock
        self._timeout = -1.0

    @classmethod
    def from_url(cls, url: SplitResult, timeout: float) -> TcpTransport:
        try:
            host, port = url.hostname, url.port
        except ValueError:
            raise BadURLError(f"bad port in {url.geturl()!r}") from None
        if not host or port is None:
            raise BadURLError(f"{url.geturl()!r}: write tcp://HOST:PORT")
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except ConnectionRefusedError:
            raise DeviceNotFoundError(
                f"nothing listens on {host}:{port}; start the card server there "
                f"(for the emulator: exstill-emu --listen tcp://{host}:{port})"
            ) from None
        except TimeoutError:
            raise LinkTimeoutError(f"connecting to {host}:{port} timed out") from None
        except OSError as exc:
            raise TransportError(f"cannot connect to {host}:{port}: {exc}") from None
        return cls(sock)

    def _write(self, data: bytes) -> None:
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise DeviceLostError(
                f"link to {self.url or 'card'} lost while sending: {exc}"
            ) from None

    def _read_into(self, view: memoryview, deadline: float) -> int:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise LinkTimeoutError(f"no reply from {self.url or 'card'} before the deadline")
        sock = self._sock
        try:
            # Re-arm the kernel timeout only when the bound has moved by more than 10 ms.
            if abs(self._timeout - remaining) > 0.01:
                seconds = int(remaining)
                micros = max(1, int((remaining - seconds) * 1e6)) if seconds == 0 else 0
                timeval = _TIMEVAL.pack(seconds, micros)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
                self._timeout = remaining
            n = sock.recv_into(view)
        except (BlockingIOError, TimeoutError):
            raise LinkTimeoutError(
                f"no reply from {self.url or 'card'} before the deadline"
            ) from None
        except OSError as exc:
            raise DeviceLostError(f"link to {self.url or 'card'} lost: {exc}") from None
        if n == 0:
            raise DeviceLostError(f"{self.url or 'the card'} closed the connection")
        return n

    def interrupt(self) -> None:
        """Both directions shut down under the reader's feet, as a dropped connection."""
        self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._sock.close()
