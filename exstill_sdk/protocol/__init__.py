"""Wire protocol v1 (docs/protocol.md is the normative byte-level specification).

constants.py  opcodes, error codes, flags, limits
frame.py      frame header and CRC (struct fast path)
messages.py   every payload (struct fast path)
framing.py    COBS framing for byte-stream links
schema.py     the formal construct schema of all of the above, and frame tracing
"""

from exstill_sdk.protocol.constants import (
    MAX_PAYLOAD,
    PROTOCOL_VERSION,
    DraftFlags,
    ErrorCode,
    Features,
    ModelKind,
    Opcode,
    WireMode,
)

__all__ = [
    "MAX_PAYLOAD",
    "PROTOCOL_VERSION",
    "DraftFlags",
    "ErrorCode",
    "Features",
    "ModelKind",
    "Opcode",
    "WireMode",
]
