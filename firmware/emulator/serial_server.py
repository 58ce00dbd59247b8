"""Serve a CardRuntime on a serial line: a pseudo-terminal here, a UART on a card.

``PtyCardServer`` opens a pty pair in raw mode, keeps the card end (the master) and serves
COBS-framed frames on it; hosts open the other end (``path``) with pyserial like any serial
port. The server holds the terminal end open itself, so a host closing the port is not an
error: the next host's HELLO starts a fresh session.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import tty

from ..runtime import CardRuntime
from .link import HostLink

log = logging.getLogger(__name__)


class PtyCardServer:
    def __init__(self, runtime: CardRuntime) -> None:
        self.runtime = runtime
        self.master, self._terminal = os.openpty()
        tty.setraw(self._terminal)
        self.path = os.ttyname(self._terminal)
        self._stop_r, self._stop_w = os.pipe()
        self._stopped = threading.Event()
        self._reset = threading.Event()

    @property
    def url(self) -> str:
        return f"serial://{self.path}"

    def stop(self) -> None:
        """Ask serve_forever to return; safe from a signal handler or another thread."""
        if not self._stopped.is_set():
            self._stopped.set()
            os.write(self._stop_w, b"\x00")

    def reset(self) -> None:
        """Simulate a card restart: the host's session (and its streams) is forgotten; the
        next stream request gets HANDSHAKE_REQUIRED, which the SDK reports as DeviceLost."""
        self._reset.set()
        os.write(self._stop_w, b"\x01")

    def serve_forever(self) -> None:
        link = HostLink(self.runtime, self.path, single_host=True)
        try:
            while not self._stopped.is_set():
                ready, _, _ = select.select([self.master, self._stop_r], [], [])
                if self._stop_r in ready:
                    os.read(self._stop_r, 64)
                    if self._reset.is_set():
                        self._reset.clear()
                        link.close()
                        link = HostLink(self.runtime, self.path, single_host=True)
                    if self._stopped.is_set():
                        break
                    continue
                try:
                    data = os.read(self.master, 1 << 16)
                except OSError:  # no terminal end open (cannot happen while we hold one)
                    continue
                replies = link.feed(data)
                if replies:
                    os.write(self.master, replies)
                link.after_replies(lambda: bool(select.select([self.master], [], [], 0)[0]))
        finally:
            link.close()
            for fd in (self.master, self._terminal, self._stop_r, self._stop_w):
                os.close(fd)
