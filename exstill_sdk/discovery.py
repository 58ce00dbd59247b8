"""Finding cards: USB devices with the card's VID/PID, serial ports whose USB VID/PID is the
card's, and any card URLs the caller names (emulators)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from exstill_sdk.errors import ExstillError
from exstill_sdk.protocol.usb_ids import PRODUCT_ID, VENDOR_ID


@dataclass(frozen=True)
class DeviceInfo:
    url: str
    kind: str
    """usb, serial, or the scheme of a named URL."""
    description: str
    serial_number: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _usb_devices(backend: Any = None) -> list[DeviceInfo]:
    import usb.core
    import usb.util

    from exstill_sdk.transport.usb import default_backend

    try:
        backend = backend or default_backend()
        devices = list(
            usb.core.find(find_all=True, idVendor=VENDOR_ID, idProduct=PRODUCT_ID, backend=backend)
        )
    except (ExstillError, usb.core.USBError):
        return []  # no libusb on this host, or the bus cannot be read
    out = []
    for dev in devices:
        try:
            serial = usb.util.get_string(dev, dev.iSerialNumber)
            product = usb.util.get_string(dev, dev.iProduct) or "Exstill card"
        except (usb.core.USBError, ValueError, NotImplementedError):
            serial, product = None, "Exstill card (strings unreadable: permissions?)"
        query = f"?serial={serial}" if serial else ""
        out.append(
            DeviceInfo(
                f"usb://{VENDOR_ID:04x}:{PRODUCT_ID:04x}{query}",
                "usb",
                f"{product} at bus {dev.bus} address {dev.address}",
                serial,
            )
        )
    return out


def _serial_ports() -> list[DeviceInfo]:
    from serial.tools import list_ports

    return [
        DeviceInfo(f"serial://{p.device}", "serial", p.description or p.device, p.serial_number)
        for p in list_ports.comports()
        if p.vid == VENDOR_ID and p.pid == PRODUCT_ID
    ]


def list_devices(urls: Iterable[str] = (), usb_backend: Any = None) -> list[DeviceInfo]:
    """Cards on USB and serial, then each named URL that answers a handshake."""
    from exstill_sdk.card import open_card

    found = _usb_devices(usb_backend) + _serial_ports()
    for url in urls:
        try:
            with open_card(url, timeout=2) as card:
                info = card.info()
        except ExstillError as exc:
            found.append(DeviceInfo(url, url.split(":", 1)[0], f"not answering: {exc.message}"))
            continue
        found.append(
            DeviceInfo(
                url,
                url.split(":", 1)[0],
                f"{info.firmware}, {info.slots} streams x {info.context} tokens",
            )
        )
    return found
