"""The abstract Transport and the registry that picks one by URL scheme.

A transport moves whole frames: ``send_frame`` writes one, ``recv_frame`` returns the next
one received before a deadline. Byte-stream links (TCP, serial) add COBS framing underneath
(``bytestream.py``); USB bulk transfers and the in-process emulator carry frames as they are.
Backends register by scheme, as python-can's buses do by interface name; a backend's module is
imported only when its scheme is used, so pyusb is not loaded for a TCP user.
"""

from __future__ import annotations

import importlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from types import TracebackType
from typing import ClassVar
from urllib.parse import SplitResult, parse_qs, urlsplit

from exstill_sdk.errors import BadURLError

log = logging.getLogger("exstill_sdk.trace")


class Transport(ABC):
    scheme: ClassVar[str]
    url: str = ""

    @classmethod
    @abstractmethod
    def from_url(cls, url: SplitResult, timeout: float) -> Transport:
        """Open a link from a parsed URL; ``timeout`` bounds connecting."""

    @abstractmethod
    def send_frame(self, frame: bytes) -> None:
        """Write one frame."""

    def send_frames(self, frames: Sequence[bytes]) -> None:
        """Write several frames; a byte-stream link writes them at once, so that the card
        reads them together (and serves them as one batch)."""
        for frame in frames:
            self.send_frame(frame)

    @abstractmethod
    def recv_frame(self, deadline: float) -> bytes:
        """The next received frame; LinkTimeoutError once ``time.monotonic()`` passes
        ``deadline``. The frame is unchecked: the caller verifies its CRC."""

    @abstractmethod
    def close(self) -> None:
        """Release the link; safe to call twice."""

    def interrupt(self) -> None:
        """Break the link as a pulled cable would: what is in flight is lost and the next
        request fails. For fault injection (tests, benchmarks of resuming)."""
        self.close()

    def __enter__(self) -> Transport:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def query_params(url: SplitResult) -> dict[str, str]:
    """A URL's query as single values; a repeated or empty key is a BadURLError."""
    params = parse_qs(url.query, keep_blank_values=True, strict_parsing=False)
    out = {}
    for key, values in params.items():
        if len(values) != 1 or values[0] == "":
            raise BadURLError(f"URL parameter {key!r} needs exactly one value")
        out[key] = values[0]
    return out


def int_param(params: dict[str, str], key: str, default: int) -> int:
    raw = params.pop(key, None)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise BadURLError(f"URL parameter {key}={raw!r} is not an integer") from None


_REGISTRY: dict[str, str | type[Transport]] = {
    "emu": "exstill_sdk.transport.emu:EmuTransport",
    "tcp": "exstill_sdk.transport.tcp:TcpTransport",
    "serial": "exstill_sdk.transport.serial:SerialTransport",
    "usb": "exstill_sdk.transport.usb:UsbTransport",
}


def register_transport(scheme: str, backend: str | type[Transport]) -> None:
    """Add a backend: a Transport class, or "module:Class" imported on first use."""
    _REGISTRY[scheme.lower()] = backend


def unregister_transport(scheme: str) -> None:
    """Remove a backend added with ``register_transport`` (no error if unknown)."""
    _REGISTRY.pop(scheme.lower(), None)


def transport_schemes() -> list[str]:
    return sorted(_REGISTRY)


def _backend(scheme: str) -> type[Transport]:
    entry = _REGISTRY.get(scheme)
    if entry is None:
        raise BadURLError(
            f"unknown link scheme {scheme!r}; use one of: "
            + ", ".join(f"{s}://" for s in transport_schemes())
        )
    if isinstance(entry, str):
        module, _, name = entry.partition(":")
        entry = getattr(importlib.import_module(module), name)
        _REGISTRY[scheme] = entry
    return entry


def open_transport(url: str, timeout: float = 5.0) -> Transport:
    """Open the link a URL names, e.g. ``emu://``, ``tcp://127.0.0.1:7700``."""
    parts = urlsplit(url)
    if not parts.scheme:
        raise BadURLError(f"{url!r} has no scheme; write e.g. emu:// or tcp://HOST:PORT")
    transport = _backend(parts.scheme.lower()).from_url(parts, timeout)
    transport.url = url
    return transport


class TracingTransport(Transport):
    """Logs every frame both ways, decoded with the formal schema (``exstill_sdk.trace``)."""

    scheme = "trace"

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.url = inner.url

    @classmethod
    def from_url(cls, url: SplitResult, timeout: float) -> Transport:
        raise BadURLError("trace wraps another link; pass trace=True to open_card")

    def send_frame(self, frame: bytes) -> None:
        from exstill_sdk.protocol.schema import describe_frame

        log.debug("-> %s", describe_frame(frame))
        self.inner.send_frame(frame)

    def send_frames(self, frames: Sequence[bytes]) -> None:
        from exstill_sdk.protocol.schema import describe_frame

        for frame in frames:
            log.debug("-> %s", describe_frame(frame))
        self.inner.send_frames(frames)

    def recv_frame(self, deadline: float) -> bytes:
        from exstill_sdk.protocol.schema import describe_frame

        frame = self.inner.recv_frame(deadline)
        log.debug("<- %s", describe_frame(frame))
        return frame

    def close(self) -> None:
        self.inner.close()
