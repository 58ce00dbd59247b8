"""Serve a CardRuntime on TCP: one thread per client, COBS-framed frames.

Each connection's thread blocks in ``recv`` and hands what it read to its HostLink (link.py:
whole frames to the runtime, which serves one request at a time under its own lock), writes the
replies of that read with one ``sendall``, and then runs the runtime's prefetch work while the
client verifies. The runtime must be created with
``background_prefetch=False``. A thread blocked in ``recv`` wakes once per read, where a
selector loop adds a system call and several microseconds of Python per round; a client that
stops reading stalls only its own thread. A client that
disconnects, even mid-frame, loses its streams and nothing else.
"""

from __future__ import annotations

import ipaddress
import logging
import select
import socket
import threading
import time
from contextlib import suppress

from exstill_sdk.errors import InvalidArgumentError
from exstill_sdk.protocol.constants import ErrorCode
from exstill_sdk.protocol.framing import Deframer, encode_stream_frame

from ..runtime import CardRuntime
from ..store import PowerCut
from ..streams import NETWORK, REMOTE
from .link import HostLink

log = logging.getLogger(__name__)

SEND_TIMEOUT = 10.0
"""A client that does not read its replies for this long is disconnected."""
MAX_CONNECTIONS = 64
"""Connections served at once by default. Each holds at most one partial frame (the deframer
drops anything longer than the largest frame, about 1 MiB), so this also bounds the memory that
clients can make the card buffer."""
REFUSE_TIMEOUT = 2.0


class TcpCardServer:
    def __init__(
        self,
        runtime: CardRuntime,
        host: str = "127.0.0.1",
        port: int = 0,
        max_connections: int = MAX_CONNECTIONS,
        remote_needs_key: bool = True,
        poll_s: float = 0.0,
    ) -> None:
        """``remote_needs_key``: a client on another host must prove the runtime's admin key
        for every request (False: for administration only, as on loopback). ``poll_s``: after
        its replies and prefetch work, a connection's thread polls the socket this long before
        it sleeps in ``recv``, as a card's firmware polls its link (a process woken from sleep
        on a shared machine can take hundreds of microseconds to run); it spends a core doing
        so, so it is for an emulator on a core of its own."""
        if max_connections < 1:
            raise InvalidArgumentError(f"max_connections must be at least 1, not {max_connections}")
        if poll_s < 0:
            raise InvalidArgumentError(f"poll time must be 0 or more, not {poll_s}")
        self.poll_s = poll_s
        self.runtime = runtime
        self.max_connections = max_connections
        self.remote_needs_key = remote_needs_key
        self.refused = 0
        """Connections turned away because max_connections were being served."""
        self._listener = socket.create_server((host, port))
        self._listener.settimeout(0.5)
        self.host, self.port = self._listener.getsockname()[:2]
        self._clients: dict[socket.socket, threading.Thread] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.powered_off = False
        """The store's power-cut fault fired: the card stopped (exstill-emu exits 75)."""

    @property
    def url(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def connections(self) -> int:
        """Connections being served now."""
        with self._lock:
            return len(self._clients)

    def stop(self) -> None:
        """Ask serve_forever to return; safe from a signal handler or another thread."""
        self._stopping.set()

    def serve_forever(self) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    sock, addr = self._listener.accept()
                except TimeoutError:
                    continue
                except OSError:
                    if self._stopping.is_set():
                        break
                    raise
                with self._lock:
                    full = len(self._clients) >= self.max_connections
                thread = threading.Thread(
                    target=self._refuse if full else self._serve_client,
                    args=(sock, f"{addr[0]}:{addr[1]}"),
                    name=f"exstill-client-{addr[1]}",
                    daemon=True,
                )
                if full:
                    self.refused += 1
                else:
                    with self._lock:
                        self._clients[sock] = thread
                thread.start()
        finally:
            self.close()

    def close(self) -> None:
        """Stop serving and free the port at once (a thread blocked in accept is woken)."""
        self._stopping.set()
        with suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            clients = list(self._clients.items())
        for sock, _ in clients:
            with suppress(OSError):  # already closed by its client
                sock.shutdown(socket.SHUT_RDWR)
        for _, thread in clients:
            thread.join(timeout=5)

    def _refuse(self, sock: socket.socket, peer: str) -> None:
        """Answer the first request of a connection beyond the limit with CARD_FULL, then
        close it: the client learns why at once instead of by a timeout."""
        try:
            sock.settimeout(REFUSE_TIMEOUT)
            deframer = Deframer()
            frames: list[bytes] = []
            while not frames:
                data = sock.recv(4096)
                if not data:
                    return
                frames = deframer.feed(data)
            message = (
                f"the card serves {self.max_connections} connections already; close one, or "
                "start the emulator with a larger --max-connections"
            )
            reply = self.runtime.refusal(frames[0], ErrorCode.CARD_FULL, message)
            sock.sendall(encode_stream_frame(reply))
        except (OSError, TimeoutError):
            pass
        finally:
            sock.close()
            log.info("client %s refused: %d connections served", peer, self.max_connections)

    def _serve_client(self, sock: socket.socket, peer: str) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(SEND_TIMEOUT)
        runtime = self.runtime
        host = sock.getpeername()[0]
        local = ipaddress.ip_address(host.split("%")[0]).is_loopback
        link = REMOTE if self.remote_needs_key and not local else NETWORK
        host_link = HostLink(runtime, peer, link)
        buffer = bytearray(1 << 16)
        why = "disconnected"
        log.info("client %s connected", peer)
        try:
            while True:
                if self.poll_s:
                    _poll(sock, self.poll_s)
                try:
                    n = sock.recv_into(buffer)
                except TimeoutError:
                    continue  # idle client: keep its streams
                if n == 0:
                    break
                replies = host_link.feed(buffer[:n])
                if replies:
                    sock.sendall(replies)
                host_link.after_replies(lambda: _readable(sock))
        except OSError as exc:
            why = str(exc) or type(exc).__name__
        except PowerCut:
            why = "power cut"
            self.powered_off = True
            self.stop()
        finally:
            host_link.close()
            sock.close()
            with self._lock:
                self._clients.pop(sock, None)
            log.info("client %s gone: %s", peer, why)


def _readable(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def _poll(sock: socket.socket, seconds: float) -> None:
    """Return when ``sock`` is readable or ``seconds`` have passed, without sleeping."""
    until = time.perf_counter() + seconds
    while not _readable(sock) and time.perf_counter() < until:
        pass
