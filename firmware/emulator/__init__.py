"""Glue that serves the card runtime on a host link (what a card's USB/serial front end does)."""

from .link import HostLink
from .loading import CardOptions, build_engines, build_runtime
from .serial_server import PtyCardServer
from .tcp_server import TcpCardServer

__all__ = [
    "CardOptions",
    "HostLink",
    "PtyCardServer",
    "TcpCardServer",
    "build_engines",
    "build_runtime",
]
