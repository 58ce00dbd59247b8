from __future__ import annotations

from urllib.parse import SplitResult

import pytest

from exstill_sdk import BadURLError, open_card
from exstill_sdk.transport import (
    Transport,
    open_transport,
    register_transport,
    transport_schemes,
    unregister_transport,
)
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
    try:
        with open_card("loopemu://?streams=2") as card:
            assert card.info().slots == 2
            assert card.url == "loopemu://?streams=2"
    finally:
        unregister_transport("loopemu")
    assert "loopemu" not in transport_schemes()


def test_emu_options() -> None:
    with open_card("emu://?streams=7&context=100&max_k=4&prefetch=0") as card:
        info = card.info()
        assert (info.slots, info.context, info.max_k, int(info.features) & 1) == (7, 100, 4, 0)
    with pytest.raises(BadURLError):
        open_card("emu://?streams=0")
    with pytest.raises(BadURLError):
        open_card("emu://?streams=1&streams=2")


def test_emu_threads_option_sets_the_engines_compute_threads() -> None:
    from urllib.parse import urlsplit

    from exstill_firmware.engines.transformer import TransformerEngine

    from exstill_sdk.card import Card
    from exstill_sdk.demo import demo_dir
    from exstill_sdk.transport.emu import EmuTransport

    image = demo_dir() / "draft.img"
    for threads in (1, 2):
        url = urlsplit(f"emu://?streams=2&context=64&threads={threads}&image={image}")
        transport = EmuTransport.from_url(url, 5.0)
        engines = [e for e in transport.runtime.models.values() if isinstance(e, TransformerEngine)]
        options = engines[0].runner.session.get_session_options()
        assert options.intra_op_num_threads == threads
        with Card(transport) as card:
            stream = card.open_stream(target="demo-draft")
            stream.prefill([1, 2, 3])
            assert len(stream.draft(3).tokens) == 3
    with pytest.raises(BadURLError, match="threads"):
        open_card("emu://?threads=two")
