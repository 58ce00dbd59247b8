"""Shared fixtures: real runtimes, real sockets, real processes; nothing mocked."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from exstill_firmware import CardRuntime
from exstill_firmware.emulator import TcpCardServer
from hypothesis import settings

settings.register_profile("ci", deadline=None, print_blob=True)
settings.load_profile("ci")


@pytest.fixture
def tcp_server() -> Iterator[TcpCardServer]:
    """A card runtime served on a free loopback port from a thread of this process."""
    runtime = CardRuntime(slots=12, context=4096, background_prefetch=False)
    server = TcpCardServer(runtime, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.stop()
    thread.join(timeout=5)
    runtime.shutdown()
