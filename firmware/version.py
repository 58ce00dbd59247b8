"""The card runtime's version, reported in HELLO as the firmware string."""

__version__ = "0.1.0"
