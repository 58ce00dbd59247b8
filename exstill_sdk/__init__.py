"""Exstill SDK: talk to an Exstill draft card (or its emulator) for speculative decoding.

>>> from exstill_sdk import open_card
>>> with open_card("emu://") as card, card.open_stream("lookup") as s:
...     s.prefill([1, 2, 3, 1, 2])
...     draft = s.draft(4)
"""

from exstill_sdk.card import Card, CardInfo, Draft, DraftStream, open_card
from exstill_sdk.discovery import DeviceInfo, list_devices
from exstill_sdk.errors import (
    BadURLError,
    CardFullError,
    CardInternalError,
    CheckpointError,
    ChunkError,
    ContextFullError,
    DeviceBusyError,
    DeviceLostError,
    DeviceNotFoundError,
    DevicePermissionError,
    DowngradeRefusedError,
    ExstillError,
    ImageError,
    ImageNotFoundError,
    ImageSignatureError,
    InvalidArgumentError,
    LinkTimeoutError,
    NoImageStoreError,
    NotACardError,
    NotAuthorizedError,
    ProtocolError,
    StoreError,
    StoreFullError,
    StreamHandleError,
    TargetOutputError,
    TokenizerMismatchError,
    TransportError,
    UnknownModelError,
)
from exstill_sdk.interface import CardInterface
from exstill_sdk.pool import CardPool, open_cards
from exstill_sdk.protocol.constants import ErrorCode, WireMode
from exstill_sdk.protocol.drafts import Verdict
from exstill_sdk.version import __version__

__all__ = [
    "BadURLError",
    "Card",
    "CardFullError",
    "CardInfo",
    "CardInterface",
    "CardInternalError",
    "CardPool",
    "CheckpointError",
    "ChunkError",
    "ContextFullError",
    "DeviceBusyError",
    "DeviceInfo",
    "DeviceLostError",
    "DeviceNotFoundError",
    "DevicePermissionError",
    "DowngradeRefusedError",
    "Draft",
    "DraftStream",
    "ErrorCode",
    "ExstillError",
    "ImageError",
    "ImageNotFoundError",
    "ImageSignatureError",
    "InvalidArgumentError",
    "LinkTimeoutError",
    "NoImageStoreError",
    "NotACardError",
    "NotAuthorizedError",
    "ProtocolError",
    "StoreError",
    "StoreFullError",
    "StreamHandleError",
    "TargetOutputError",
    "TokenizerMismatchError",
    "TransportError",
    "UnknownModelError",
    "Verdict",
    "WireMode",
    "__version__",
    "list_devices",
    "open_card",
    "open_cards",
]
