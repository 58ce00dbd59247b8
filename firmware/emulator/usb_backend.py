"""The emulated card as a USB device, for pyusb.

``EmulatedUsbBackend`` implements pyusb's backend interface (``usb.backend.IBackend``): it
enumerates emulated cards with real descriptors (device, one configuration, a vendor-specific
interface with a bulk OUT and a bulk IN endpoint, manufacturer / product / serial / interface
strings, the firmware version as the configuration string and in bcdDevice) and routes bulk
transfers to the card runtime.
``usb.core.find`` and the SDK's whole ``usb://`` transport run unmodified against it.

Faults for tests: ``card.inject("stall" | "timeout", count)`` fails the next transfers as a
device would; ``card.reset()`` restarts the card (a fresh runtime: every stream is gone), fails
whatever the host had open with ENODEV and re-enumerates it at a new address;
``card.unplug()`` / ``card.plug()`` remove and restore it.
"""

from __future__ import annotations

import errno
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import usb.backend
import usb.core

from exstill_sdk.protocol.usb_ids import INTERFACE_CLASS, PRODUCT_ID, VENDOR_ID

from ..runtime import CardRuntime
from ..version import __version__
from .link import HostLink

EP_OUT, EP_IN = 0x01, 0x81
MAX_PACKET = 512
STRINGS = {
    1: "Exstill",
    2: "Exstill draft card (emulated)",
    4: "exstill-draft",
    5: f"firmware exstill-emu {__version__}",
}


@dataclass
class EmulatedCard:
    make_runtime: Callable[[], CardRuntime]
    serial: str
    address: int
    runtime: CardRuntime = field(init=False)
    link: HostLink = field(init=False)
    generation: int = 0
    plugged: bool = True
    configuration: int = 0
    kernel_driver: bool = True
    denied: bool = False
    """Refuse to open, as a device node without permission does (errno 13)."""
    claimed_by: object | None = None
    faults: deque[str] = field(default_factory=deque)
    replies: deque[bytes] = field(default_factory=deque)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.runtime = self.make_runtime()
        self.link = HostLink(self.runtime, f"usb:{self.serial}", single_host=True)

    def inject(self, fault: str, count: int = 1) -> None:
        if fault not in ("stall", "timeout"):
            raise ValueError("faults: stall, timeout")
        self.faults.extend([fault] * count)

    def reset(self) -> None:
        """Power-cycle: a fresh runtime, open handles fail, the card re-enumerates."""
        with self.lock:
            self.link.close()
            self.runtime.shutdown()
            self.runtime = self.make_runtime()
            self.link = HostLink(self.runtime, f"usb:{self.serial}", single_host=True)
            self.generation += 1
            self.address += 1
            self.configuration = 0
            self.claimed_by = None
            self.replies.clear()

    def unplug(self) -> None:
        self.plugged = False
        self.generation += 1

    def plug(self) -> None:
        self.plugged = True

    def firmware_bcd(self) -> int:
        major, minor, *_ = ([*__version__.split("."), "0", "0"])[:2]
        return (int(major) << 8) | int(minor)


@dataclass(eq=False)  # handles compare by identity, as libusb handles do
class _Handle:
    card: EmulatedCard
    generation: int


def _fail(code: int, text: str) -> usb.core.USBError:
    if code == errno.ETIMEDOUT:
        return usb.core.USBTimeoutError(text, -7, code)
    return usb.core.USBError(text, None, code)


class EmulatedUsbBackend(usb.backend.IBackend):
    def __init__(self) -> None:
        self.cards: list[EmulatedCard] = []

    def add_card(
        self, make_runtime: Callable[[], CardRuntime] | None = None, serial: str | None = None
    ) -> EmulatedCard:
        card = EmulatedCard(
            make_runtime or (lambda: CardRuntime(prefetch=True, background_prefetch=True)),
            serial or f"EMU{len(self.cards) + 1:04d}",
            address=len(self.cards) * 8 + 2,
        )
        self.cards.append(card)
        return card

    # ------------------------------------------------------------------ descriptors

    def enumerate_devices(self) -> Iterator[EmulatedCard]:
        return iter([c for c in self.cards if c.plugged])

    def get_parent(self, dev: EmulatedCard) -> None:
        return None

    def get_device_descriptor(self, dev: EmulatedCard) -> Any:
        return SimpleNamespace(
            bLength=18,
            bDescriptorType=1,
            bcdUSB=0x0200,
            bDeviceClass=0,
            bDeviceSubClass=0,
            bDeviceProtocol=0,
            bMaxPacketSize0=64,
            idVendor=VENDOR_ID,
            idProduct=PRODUCT_ID,
            bcdDevice=dev.firmware_bcd(),
            iManufacturer=1,
            iProduct=2,
            iSerialNumber=3,
            bNumConfigurations=1,
            address=dev.address,
            bus=1,
            port_number=1,
            port_numbers=(1,),
            speed=3,
        )

    def get_configuration_descriptor(self, dev: EmulatedCard, config: int) -> Any:
        if config != 0:
            raise IndexError("one configuration")
        return SimpleNamespace(
            bLength=9,
            bDescriptorType=2,
            wTotalLength=32,
            bNumInterfaces=1,
            bConfigurationValue=1,
            iConfiguration=5,
            bmAttributes=0x80,
            bMaxPower=250,
            extra_descriptors=[],
        )

    def get_interface_descriptor(self, dev: EmulatedCard, intf: int, alt: int, config: int) -> Any:
        if (intf, alt, config) != (0, 0, 0):
            raise IndexError("one interface")
        return SimpleNamespace(
            bLength=9,
            bDescriptorType=4,
            bInterfaceNumber=0,
            bAlternateSetting=0,
            bNumEndpoints=2,
            bInterfaceClass=INTERFACE_CLASS,
            bInterfaceSubClass=0,
            bInterfaceProtocol=0,
            iInterface=4,
            extra_descriptors=[],
        )

    def get_endpoint_descriptor(
        self, dev: EmulatedCard, ep: int, intf: int, alt: int, config: int
    ) -> Any:
        if ep not in (0, 1):
            raise IndexError("two endpoints")
        return SimpleNamespace(
            bLength=7,
            bDescriptorType=5,
            bEndpointAddress=(EP_OUT, EP_IN)[ep],
            bmAttributes=2,
            wMaxPacketSize=MAX_PACKET,
            bInterval=0,
            bRefresh=0,
            bSynchAddress=0,
            extra_descriptors=[],
        )

    # ------------------------------------------------------------------ handles

    def _live(self, handle: _Handle) -> EmulatedCard:
        card = handle.card
        if not card.plugged or handle.generation != card.generation:
            raise _fail(errno.ENODEV, "No such device (it may have been disconnected)")
        return card

    def open_device(self, dev: EmulatedCard) -> _Handle:
        if not dev.plugged:
            raise _fail(errno.ENODEV, "No such device")
        if dev.denied:
            raise _fail(errno.EACCES, "Access denied (insufficient permissions)")
        return _Handle(dev, dev.generation)

    def close_device(self, dev_handle: _Handle) -> None:
        if dev_handle.card.claimed_by is dev_handle:
            dev_handle.card.claimed_by = None

    def set_configuration(self, dev_handle: _Handle, config_value: int) -> None:
        self._live(dev_handle).configuration = config_value

    def get_configuration(self, dev_handle: _Handle) -> int:
        return self._live(dev_handle).configuration

    def set_interface_altsetting(self, dev_handle: _Handle, intf: int, altsetting: int) -> None:
        self._live(dev_handle)

    def claim_interface(self, dev_handle: _Handle, intf: int) -> None:
        card = self._live(dev_handle)
        if card.kernel_driver:
            raise _fail(errno.EBUSY, "Resource busy (a kernel driver holds the interface)")
        if card.claimed_by is not None and card.claimed_by is not dev_handle:
            raise _fail(errno.EBUSY, "Resource busy (another handle claimed the interface)")
        card.claimed_by = dev_handle

    def release_interface(self, dev_handle: _Handle, intf: int) -> None:
        if dev_handle.card.claimed_by is dev_handle:
            dev_handle.card.claimed_by = None

    def is_kernel_driver_active(self, dev_handle: _Handle, intf: int) -> bool:
        return self._live(dev_handle).kernel_driver

    def detach_kernel_driver(self, dev_handle: _Handle, intf: int) -> None:
        self._live(dev_handle).kernel_driver = False

    def attach_kernel_driver(self, dev_handle: _Handle, intf: int) -> None:
        self._live(dev_handle).kernel_driver = True

    def clear_halt(self, dev_handle: _Handle, ep: int) -> None:
        self._live(dev_handle)

    def reset_device(self, dev_handle: _Handle) -> None:
        dev_handle.card.reset()

    # ------------------------------------------------------------------ transfers

    def _fault(self, card: EmulatedCard) -> None:
        if card.faults:
            fault = card.faults.popleft()
            if fault == "stall":
                raise _fail(errno.EPIPE, "Pipe error (endpoint stalled)")
            raise _fail(errno.ETIMEDOUT, "Operation timed out")

    def bulk_write(self, dev_handle: _Handle, ep: int, intf: int, data: Any, timeout: int) -> int:
        card = self._live(dev_handle)
        if ep != EP_OUT or card.claimed_by is not dev_handle:
            raise _fail(errno.EINVAL, "Invalid endpoint or interface not claimed")
        self._fault(card)
        with card.lock:
            reply = card.link.handle(bytes(data))
        if reply is not None:
            card.replies.append(reply)
        return len(data)

    def bulk_read(self, dev_handle: _Handle, ep: int, intf: int, buff: Any, timeout: int) -> int:
        card = self._live(dev_handle)
        if ep != EP_IN or card.claimed_by is not dev_handle:
            raise _fail(errno.EINVAL, "Invalid endpoint or interface not claimed")
        self._fault(card)
        if not card.replies:
            raise _fail(errno.ETIMEDOUT, "Operation timed out (no data)")
        reply = card.replies.popleft()
        if len(reply) > len(buff):
            raise _fail(errno.EOVERFLOW, "Overflow (buffer smaller than the transfer)")
        buff[: len(reply)] = type(buff)(buff.typecode, reply)
        return len(reply)

    def ctrl_transfer(
        self,
        dev_handle: _Handle,
        bmRequestType: int,
        bRequest: int,
        wValue: int,
        wIndex: int,
        data: Any,
        timeout: int,
    ) -> int:
        card = self._live(dev_handle)
        if bmRequestType & 0x80 and bRequest == 6 and wValue >> 8 == 3:  # GET_DESCRIPTOR string
            index = wValue & 0xFF
            if index == 0:
                payload = bytes([4, 3, 0x09, 0x04])  # LANGID en-US
            else:
                text = card.serial if index == 3 else STRINGS.get(index)
                if text is None:
                    raise _fail(errno.EPIPE, "Pipe error (no such string)")
                raw = text.encode("utf-16-le")
                payload = bytes([2 + len(raw), 3]) + raw
            n = min(len(payload), len(data))
            data[:n] = type(data)(data.typecode, payload[:n])
            return n
        raise _fail(errno.EPIPE, "Pipe error (request not supported)")


_shared: EmulatedUsbBackend | None = None


def shared_backend() -> EmulatedUsbBackend:
    """The process's emulated USB bus, with one card plugged in (what ``?backend=emu`` uses)."""
    global _shared
    if _shared is None:
        _shared = EmulatedUsbBackend()
        _shared.add_card()
    return _shared
