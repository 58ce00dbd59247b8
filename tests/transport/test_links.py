"""The same end-to-end suite over every link: in-process, TCP, a real pseudo-terminal serial
line, and the emulated USB device through pyusb."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator

import pytest
from exstill_firmware import CardRuntime
from exstill_firmware.emulator import PtyCardServer, TcpCardServer
from exstill_firmware.emulator.usb_backend import EmulatedUsbBackend

from exstill_sdk import (
    DeviceBusyError,
    DeviceLostError,
    DevicePermissionError,
    LinkTimeoutError,
    open_card,
)
from exstill_sdk.protocol.drafts import Verdict
from exstill_sdk.speculative import SpeculativeDecoder
from exstill_sdk.transport.usb import register_usb_backend, unregister_usb_backend

from ..helpers import CycleTarget, cycle_reference

LINKS = ["emu", "tcp", "serial", "usb"]
_names = itertools.count()


class Card:
    """A card reachable over one kind of link, plus handles for fault injection."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.server = self.usb_card = None
        self.thread = None
        self.backend_name: str | None = None
        self.runtimes: list[CardRuntime] = []
        if kind == "emu":
            self.url = "emu://"
            return
        if kind == "usb":
            backend = EmulatedUsbBackend()
            self.usb_card = backend.add_card(lambda: CardRuntime(12, 16384))
            self.backend_name = f"test{next(_names)}"
            register_usb_backend(self.backend_name, backend)
            self.url = f"usb://1209:e511?backend={self.backend_name}"
            return
        self.serve(kind)

    def serve(self, kind: str, port: int = 0) -> None:
        """(Re)start the TCP or serial server, as a card does after a reset."""
        runtime = CardRuntime(12, 16384, background_prefetch=False)
        self.runtimes.append(runtime)
        self.server = TcpCardServer(runtime, port=port) if kind == "tcp" else PtyCardServer(runtime)
        self.url = self.server.url
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            assert self.thread is not None
            self.thread.join(5)
        for runtime in self.runtimes:
            runtime.shutdown()
        if self.usb_card is not None:
            self.usb_card.runtime.shutdown()
        if self.backend_name is not None:
            unregister_usb_backend(self.backend_name)


@pytest.fixture(params=LINKS)
def card(request) -> Iterator[Card]:
    c = Card(request.param)
    yield c
    c.close()


def test_end_to_end(card: Card) -> None:
    with open_card(card.url) as c:
        assert c.info().slots == 12 and c.info().engines == ("lookup",)
        s = c.open_stream()
        prompt = list(range(1, 50)) * 200  # 9,800 tokens: several PREFILL frames
        assert s.prefill(prompt) == len(prompt)
        d = s.draft(6)
        assert d.tokens == (1, 2, 3, 4, 5, 6)
        for _ in range(20):
            d = s.commit(Verdict(6, 7), 6)
            assert d.tokens == (8, 9, 10, 11, 12, 13)
            s.rollback(s.length - 7)
            d = s.draft(6)
        s.close()
        streams = [c.open_stream() for _ in range(12)]
        for i, st in enumerate(streams):
            st.prefill([100 + i, 200 + i, 300 + i] * 3)
            assert st.draft(3).tokens == (100 + i, 200 + i, 300 + i)
        for st in streams:
            st.close()
        stats = c.stats()
        assert stats["streams_open"] == 0 and stats["rounds"] >= 20


@pytest.mark.parametrize("kind", ["usb", "serial", "tcp"])
def test_decoder_survives_a_card_reset(kind: str) -> None:
    card = Card(kind)
    try:
        with open_card(card.url) as c:
            decoder = SpeculativeDecoder(c, CycleTarget(), engine="lookup", k=4)
            prompt = [5, 6, 7, 5, 6, 7]
            got = []
            for token in decoder.stream(prompt, 120, stop_token_ids=[]):
                got.append(token)
                if len(got) == 40:  # the card restarts mid-generation
                    if kind == "usb":
                        card.usb_card.reset()
                    elif kind == "serial":
                        card.server.reset()
                    else:
                        card.server.stop()
                        card.thread.join(5)
                        card.serve("tcp", port=card.server.port)
            assert got == cycle_reference(prompt, 120)
            assert decoder.reconnects == 1
    finally:
        card.close()


def test_usb_open_sequence_and_faults() -> None:
    card = Card("usb")
    usb_card = card.usb_card
    assert usb_card.kernel_driver and usb_card.configuration == 0
    import usb.core
    import usb.util

    from exstill_sdk.transport.usb import _backend

    device = usb.core.find(
        idVendor=0x1209, idProduct=0xE511, backend=_backend(card.url.rsplit("=", 1)[1])
    )
    assert (device.manufacturer, device.serial_number) == ("Exstill", "EMU0001")
    assert "Exstill draft card" in device.product
    assert usb.util.get_string(device, 5).startswith("firmware exstill-emu ")
    usb.util.dispose_resources(device)
    with open_card(card.url, timeout=1) as c:
        assert not usb_card.kernel_driver and usb_card.configuration == 1  # detached, configured
        s = c.open_stream()
        s.prefill([1, 2, 3, 1, 2])
        usb_card.inject("timeout")
        with pytest.raises(LinkTimeoutError):
            s.draft(2)
        assert s.draft(2).tokens == (3, 1)  # resynchronised, still serving
        usb_card.inject("stall")
        with pytest.raises(DeviceLostError):
            s.draft(2)
        c.reconnect()
        s = c.open_stream()
        s.prefill([4, 5, 6, 4, 5])
        assert s.draft(1).tokens == (6,)
        with pytest.raises(DeviceBusyError, match="busy"):
            open_card(card.url)  # the interface is claimed by the first client
    usb_card.denied = True
    with pytest.raises(DevicePermissionError, match=r"70-exstill\.rules"):
        open_card(card.url)
    usb_card.denied = False
    usb_card.unplug()
    from exstill_sdk import DeviceNotFoundError

    with pytest.raises(DeviceNotFoundError, match="plugged in"):
        open_card(card.url)


def test_serial_url_forms(tmp_path) -> None:
    from exstill_sdk import BadURLError, DeviceNotFoundError

    with pytest.raises(DeviceNotFoundError):
        open_card("serial:///dev/does-not-exist")
    with pytest.raises(BadURLError):
        open_card("serial://host/dev/x")
    card = Card("serial")
    try:
        with open_card(f"serial:{card.server.path}") as c:
            assert c.info().slots == 12  # the pyserial URL form: serial:<pyserial URL>
    finally:
        card.close()
