"""Links to a card, picked by URL scheme: ``emu://`` (in-process), ``tcp://HOST:PORT``,
``serial://PORT`` (pyserial), ``usb://VID:PID`` (pyusb); others register with
``register_transport``."""

from exstill_sdk.transport.base import (
    TracingTransport,
    Transport,
    open_transport,
    register_transport,
    transport_schemes,
    unregister_transport,
)

__all__ = [
    "TracingTransport",
    "Transport",
    "open_transport",
    "register_transport",
    "transport_schemes",
    "unregister_transport",
]
