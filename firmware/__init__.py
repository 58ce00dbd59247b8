"""The Exstill card runtime (installed as ``exstill_firmware``).

Transport-independent: ``CardRuntime.handle`` takes frame bytes and returns frame bytes. The
same code runs behind every emulated link (in-process, TCP) and is what a card would run.
"""

from .runtime import CardRuntime
from .streams import Session
from .version import __version__

__all__ = ["CardRuntime", "Session", "__version__"]
