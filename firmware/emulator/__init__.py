"""Glue that serves the card runtime on a host link (what a card's USB/serial front end does)."""

from .loading import build_engines
from .tcp_server import TcpCardServer

__all__ = ["TcpCardServer", "build_engines"]
