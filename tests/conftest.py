"""Shared fixtures: real runtimes, real sockets, real processes; nothing mocked."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from exstill_firmware import CardRuntime
from exstill_firmware.emulator import TcpCardServer
from hypothesis import settings

from .helpers import served

settings.register_profile("ci", deadline=None, print_blob=True)
settings.load_profile("ci")


@pytest.fixture
def tcp_server() -> Iterator[TcpCardServer]:
    """A card runtime served on a free loopback port from a thread of this process."""
    with served(CardRuntime(slots=12, context=4096, background_prefetch=False)) as server:
        yield server


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """An exstill cache directory (XDG_CACHE_HOME) holding the large demo target, built once
    for the session; set in this process's environment, so subprocesses see it too."""
    from exstill_sdk.demo import expanded_target
    from exstill_sdk.demo.targets import LARGE_HIDDEN

    base = tmp_path_factory.mktemp("xdg-cache")
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(base)
    try:
        expanded_target(LARGE_HIDDEN)
        yield base
    finally:
        if before is None:
            os.environ.pop("XDG_CACHE_HOME", None)
        else:
            os.environ["XDG_CACHE_HOME"] = before


@pytest.fixture(scope="session")
def admin_key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An admin key file (exstill-emu --admin-key, exstill-flash --key, open_card(key=))."""
    from exstill_sdk.auth import generate_admin_key

    return generate_admin_key(tmp_path_factory.mktemp("keys") / "admin.key")
