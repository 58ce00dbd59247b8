"""Glue that serves the card runtime on a host link (what a card's USB/serial front end does)."""

from .tcp_server import TcpCardServer

__all__ = ["TcpCardServer"]
