"""The Exstill card runtime (installed as ``exstill_firmware``).

Transport-independent: ``CardRuntime.handle`` takes frame bytes and returns frame bytes. The
same code runs behind every emulated link (in-process, TCP) and is what a card would run.
"""

__version__ = "0.1.0"

from .runtime import CardRuntime
from .streams import Session

__all__ = ["CardRuntime", "Session", "__version__"]
