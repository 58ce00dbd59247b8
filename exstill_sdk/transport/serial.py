"""Serial links through pyserial: ``serial:///dev/ttyACM0?baud=921600`` or any pyserial URL
after ``serial:`` (``serial:socket://host:7001``, ``serial:loop://``, ``serial:rfc2217://...``).

Frames are COBS-framed as on TCP. Reads run against the caller's deadline: each read waits for
the next bytes for at most the time left (never pyserial's ``inter_byte_timeout``). Low-latency
mode is asked for where the driver has it (Linux ASYNC_LOW_LATENCY), silently skipped elsewhere.
"""

from __future__ import annotations

import contextlib
import time
from urllib.parse import SplitResult, unquote

import serial

from exstill_sdk.errors import (
    BadURLError,
    DeviceBusyError,
    DeviceLostError,
    DeviceNotFoundError,
    DevicePermissionError,
    LinkTimeoutError,
)
from exstill_sdk.transport.base import int_param, query_params
from exstill_sdk.transport.bytestream import ByteStreamTransport

DEFAULT_BAUD = 921600


def _port_and_params(url: SplitResult) -> tuple[str, dict[str, str]]:
    raw = url.geturl()
    if raw.startswith("serial://"):
        if url.netloc:
            raise BadURLError(f"{raw!r}: write serial:///dev/NAME (three slashes) for a device")
        return unquote(url.path), query_params(url)
    # serial:<pyserial URL>: everything after the scheme is pyserial's, options included
    return raw[len("serial:") :], {}


class SerialTransport(ByteStreamTransport):
    scheme = "serial"

    def __init__(self, port: serial.SerialBase) -> None:
        super().__init__()
        self._port = port

    @classmethod
    def from_url(cls, url: SplitResult, timeout: float) -> SerialTransport:
        target, params = _port_and_params(url)
        baud = int_param(params, "baud", DEFAULT_BAUD)
        if params:
            raise BadURLError(f"unknown serial option(s) {', '.join(params)}; known: baud")
        if not target:
            raise BadURLError("serial:///dev/NAME needs a device path")
        try:
            port = serial.serial_for_url(
                target, baudrate=baud, timeout=timeout, write_timeout=timeout, exclusive=True
            )
        except serial.SerialException as exc:
            raise _map_open_error(target, exc) from None
        except ValueError as exc:  # pyserial's message for a bad URL or option
            raise BadURLError(f"{target!r}: {exc}") from None
        # not a Linux UART (a pty, a URL handler): nothing to tune
        with contextlib.suppress(AttributeError, NotImplementedError, ValueError, OSError):
            port.set_low_latency_mode(True)  # type: ignore[attr-defined]
        return cls(port)

    def _write(self, data: bytes) -> None:
        try:
            self._port.write(data)
        except serial.SerialTimeoutException:
            raise LinkTimeoutError(f"{self.url or 'serial link'}: write timed out") from None
        except (serial.SerialException, OSError) as exc:
            raise DeviceLostError(f"{self.url or 'serial link'} lost: {exc}") from None

    def _read_into(self, view: memoryview, deadline: float) -> int:
        port = self._port
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LinkTimeoutError(
                    f"no reply from {self.url or 'the card'} before the deadline"
                )
            port.timeout = remaining
            try:
                data = port.read(max(1, min(len(view), port.in_waiting)))
            except (serial.SerialException, OSError, TypeError) as exc:
                raise DeviceLostError(f"{self.url or 'serial link'} lost: {exc}") from None
            if data:
                view[: len(data)] = data
                return len(data)

    def close(self) -> None:
        self._port.close()


def _map_open_error(target: str, exc: serial.SerialException) -> Exception:
    errno = getattr(exc, "errno", None)
    text = str(exc)
    if errno == 13 or "Permission denied" in text:
        return DevicePermissionError(
            f"permission denied opening {target}: add your user to the 'dialout' group "
            "(sudo usermod -aG dialout $USER, then log in again) or install udev/70-exstill.rules"
        )
    if errno == 16 or "busy" in text.lower() or "exclusively lock" in text:
        return DeviceBusyError(
            f"{target} is busy: another process holds it (find it with: fuser {target})"
        )
    if errno == 2 or "No such file" in text or "could not open port" in text:
        return DeviceNotFoundError(f"no serial port {target}; list ports with: exstill-info --list")
    return DeviceLostError(f"cannot open {target}: {text}")
