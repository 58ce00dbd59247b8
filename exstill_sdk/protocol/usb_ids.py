"""The card's USB identity, shared by the SDK, the emulator and udev/70-exstill.rules.

Placeholders until Exstill is assigned a vendor ID: 0x1209 is the pid.codes open-hardware
vendor, and 0xE511 an unassigned product ID under it. tests/transport/test_udev.py checks the
rules file against these values.
"""

VENDOR_ID = 0x1209
PRODUCT_ID = 0xE511
INTERFACE_CLASS = 0xFF
"""A vendor-specific interface with one bulk OUT and one bulk IN endpoint."""
