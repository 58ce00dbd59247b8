from __future__ import annotations

from urllib.parse import SplitResult

import pytest

from exstill_sdk import BadURLError, open_card
from exstill_sdk.transport import Transport, open_transport, register_transport, transport_schemes
from exstill_sdk.transport.emu import EmuTransport


def test_builtin_schemes() -> None:
    assert {"emu", "tcp"} <= set(transport_schemes())


def test_unknown_scheme_lists_known_ones() -> None:
    with pytest.raises(BadURLError, match="emu://"):
        open_transport("quic://x")


def test_third_party_backend_by_scheme() -> None:
    """A backend registered under a new scheme is picked by URL, as python-can picks buses."""

    class LoopbackEmu(EmuTransport):
        scheme = "loopemu"

        @classmethod
        def from_url(cls, url: SplitResult, timeout: float) -> Transport:
            return EmuTransport.from_url(url._replace(scheme="emu"), timeout)

    register_transport("loopemu", LoopbackEmu)
    with open_card("loopemu://?streams=2") as card:
        assert card.info().slots == 2
        assert card.url == "loopemu://?streams=2"


def test_emu_options() -> None:
    with open_card("emu://?streams=7&context=100&max_k=4&prefetch=0") as card:
        info = card.info()
        assert (info.slots, info.context, info.max_k, int(info.features) & 1) == (7, 100, 4, 0)
    with pytest.raises(BadURLError):
        open_card("emu://?streams=0")
    with pytest.raises(BadURLError):
        open_card("emu://?streams=1&streams=2")
