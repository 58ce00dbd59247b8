"""``usb://VID:PID[?serial=SN]``: a card on USB through pyusb, whole frames per bulk transfer.

Opening follows what a careful libusb client does: find the device (and its serial number),
leave an already active configuration alone, detach a kernel driver bound to the vendor
interface, claim it, and use its bulk OUT and IN endpoints with a preallocated read buffer and
explicit timeouts. When pyusb finds no libusb backend, the ``libusb-package`` wheel's bundled
libusb is used if installed. OS errors become typed errors that say what to do: errno 13
(permission: the udev rule), 16 (busy), 110 (timeout), 19/5 (the card vanished or reset).

``?backend=emu`` uses the in-process emulated card (exstill_firmware.emulator.usb_backend): the
same pyusb calls, against a pyusb backend that presents the card runtime as a USB device.
"""

from __future__ import annotations

import array
import contextlib
import errno as errnos
import time
from typing import Any
from urllib.parse import SplitResult

import usb.core
import usb.util

from exstill_sdk.errors import (
    BadURLError,
    DeviceBusyError,
    DeviceLostError,
    DeviceNotFoundError,
    DevicePermissionError,
    LinkTimeoutError,
    TransportError,
)
from exstill_sdk.protocol.constants import MAX_FRAME
from exstill_sdk.protocol.usb_ids import INTERFACE_CLASS
from exstill_sdk.transport.base import Transport, query_params

UDEV_HINT = (
    "install the udev rule: sudo cp udev/70-exstill.rules /etc/udev/rules.d/ && "
    "sudo udevadm control --reload && sudo udevadm trigger (see udev/README.md)"
)
_backends: dict[str, Any] = {}


def register_usb_backend(name: str, backend: Any) -> None:
    """Make a pyusb backend selectable as ``usb://VID:PID?backend=NAME``."""
    _backends[name] = backend


def unregister_usb_backend(name: str) -> None:
    """Forget a backend registered with ``register_usb_backend`` (no error if unknown)."""
    _backends.pop(name, None)


def default_backend() -> Any:
    """libusb through pyusb, or the libusb-package wheel's copy when none is installed."""
    import usb.backend.libusb1

    backend = usb.backend.libusb1.get_backend()
    if backend is None:
        try:
            import libusb_package  # type: ignore[import-not-found]
        except ImportError:
            raise DeviceNotFoundError(
                "no libusb found: install your OS's libusb-1.0 or pip install libusb-package"
            ) from None
        backend = usb.backend.libusb1.get_backend(find_library=libusb_package.find_library)
    return backend


def _backend(name: str | None) -> Any:
    if name in (None, "libusb"):
        return default_backend()
    if name == "emu" and "emu" not in _backends:
        from exstill_firmware.emulator.usb_backend import shared_backend

        _backends["emu"] = shared_backend()
    try:
        return _backends[name]
    except KeyError:
        raise BadURLError(
            f"unknown USB backend {name!r}; known: libusb, emu, {', '.join(_backends)}"
        ) from None


def map_usb_error(exc: usb.core.USBError, what: str) -> TransportError:
    code = getattr(exc, "errno", None)
    if isinstance(exc, usb.core.USBTimeoutError) or code == errnos.ETIMEDOUT:
        return LinkTimeoutError(f"{what}: USB transfer timed out")
    if code == errnos.EACCES:
        return DevicePermissionError(f"{what}: permission denied; {UDEV_HINT}")
    if code == errnos.EBUSY:
        return DeviceBusyError(
            f"{what}: the interface is busy: another process (another exstill client) or a "
            "kernel driver holds it"
        )
    if code in (errnos.ENODEV, errnos.EIO, errnos.ENOENT, errnos.EPIPE):
        return DeviceLostError(f"{what}: the card vanished or reset ({exc})")
    return TransportError(f"{what}: USB error: {exc}")


class UsbTransport(Transport):
    scheme = "usb"

    def __init__(self, device: Any, timeout: float) -> None:
        self.device = device
        self.timeout = timeout
        what = f"USB card {device.idVendor:04x}:{device.idProduct:04x}"
        self._what = what
        try:
            try:
                config = device.get_active_configuration()
            except usb.core.USBError:
                config = None
            if config is None or config.bConfigurationValue != 1:
                device.set_configuration(1)
                config = device.get_active_configuration()
            interface = usb.util.find_descriptor(config, bInterfaceClass=INTERFACE_CLASS)
            if interface is None:
                raise DeviceNotFoundError(f"{what} has no vendor interface: not an Exstill card?")
            number = interface.bInterfaceNumber
            if device.is_kernel_driver_active(number):
                device.detach_kernel_driver(number)
            usb.util.claim_interface(device, number)
            self._interface = number
            self._out = usb.util.find_descriptor(
                interface,
                custom_match=lambda e: (
                    usb.util.endpoint_direction(e.bEndpointAddress) == usb.util.ENDPOINT_OUT
                ),
            )
            self._in = usb.util.find_descriptor(
                interface,
                custom_match=lambda e: (
                    usb.util.endpoint_direction(e.bEndpointAddress) == usb.util.ENDPOINT_IN
                ),
            )
        except usb.core.USBError as exc:
            raise map_usb_error(exc, what) from None
        self._buffer = array.array("B", bytes(MAX_FRAME))

    @classmethod
    def from_url(cls, url: SplitResult, timeout: float) -> UsbTransport:
        try:
            vid_text, _, pid_text = url.netloc.partition(":")
            vid, pid = int(vid_text, 16), int(pid_text, 16)
        except ValueError:
            raise BadURLError(
                f"{url.geturl()!r}: write usb://VID:PID in hex, e.g. usb://1209:e511"
            ) from None
        params = query_params(url)
        serial = params.pop("serial", None)
        backend = _backend(params.pop("backend", None))
        if params:
            raise BadURLError(
                f"unknown usb:// option(s) {', '.join(params)}; known: serial, backend"
            )

        def match(dev: Any) -> bool:
            if serial is None:
                return True
            try:
                return usb.util.get_string(dev, dev.iSerialNumber) == serial
            except (usb.core.USBError, ValueError):
                return False

        try:
            device = usb.core.find(idVendor=vid, idProduct=pid, backend=backend, custom_match=match)
        except usb.core.USBError as exc:
            raise map_usb_error(exc, f"USB card {vid:04x}:{pid:04x}") from None
        if device is None:
            which = f" with serial {serial}" if serial else ""
            raise DeviceNotFoundError(
                f"no USB card {vid:04x}:{pid:04x}{which}: is it plugged in? (lsusb; "
                "exstill-info --list)"
            )
        return cls(device, timeout)

    def send_frame(self, frame: bytes) -> None:
        try:
            self._out.write(frame, timeout=max(1, int(self.timeout * 1000)))
        except usb.core.USBError as exc:
            raise map_usb_error(exc, self._what) from None

    def recv_frame(self, deadline: float) -> bytes:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise LinkTimeoutError(f"{self._what}: no reply before the deadline")
        try:
            n = self._in.read(self._buffer, timeout=max(1, int(remaining * 1000)))
        except usb.core.USBError as exc:
            raise map_usb_error(exc, self._what) from None
        return self._buffer[:n].tobytes()

    def close(self) -> None:
        with contextlib.suppress(usb.core.USBError, AttributeError):
            usb.util.release_interface(self.device, self._interface)
        usb.util.dispose_resources(self.device)
