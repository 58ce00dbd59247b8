"""One exception hierarchy for the SDK, rooted in ExstillError.

Every error carries a ``code`` from :class:`~exstill_sdk.protocol.constants.ErrorCode`; codes
below 256 are the ones a card sends in ERROR replies, so a card's error arrives as the same
class the SDK would raise itself.
"""

from __future__ import annotations

from exstill_sdk.protocol.constants import ErrorCode


class ExstillError(Exception):
    """Base of every error the SDK raises."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class ProtocolError(ExstillError):
    """A malformed frame or payload, an unknown opcode, or a version no side speaks."""

    code = ErrorCode.BAD_PAYLOAD


class NotACardError(ProtocolError):
    """Something answered at the link's address, but not as an Exstill card (its first bytes
    cannot begin a card's reply): the URL names another service."""


class StreamHandleError(ExstillError):
    """The handle does not name an open stream of this connection."""

    code = ErrorCode.BAD_HANDLE


class CardFullError(ExstillError):
    """Every stream slot is in use."""

    code = ErrorCode.CARD_FULL


class ContextFullError(ExstillError):
    """The stream's context would grow past its slot."""

    code = ErrorCode.CONTEXT_FULL


class InvalidArgumentError(ExstillError, ValueError):
    """An argument out of range: K, an accepted count, a rollback length, a sampling value."""

    code = ErrorCode.BAD_ARGUMENT


class CheckpointError(InvalidArgumentError):
    """A checkpoint that exstill-pack cannot turn into a card image: unsupported family or
    option, missing files, inconsistent tensors. The message names what is supported."""


class UnknownModelError(ExstillError, LookupError):
    """The card has no engine or target of that name."""

    code = ErrorCode.UNKNOWN_MODEL


class CardInternalError(ExstillError):
    """The card failed while serving a request; the request had no effect on other streams."""

    code = ErrorCode.INTERNAL


class ImageError(ExstillError):
    """A card image is malformed, inconsistent, or fails its digest; the message names the
    problem (the field, the offset, the tensor)."""

    code = ErrorCode.BAD_IMAGE


class ImageNotFoundError(ImageError, FileNotFoundError):
    """No card image at that path."""


class ImageSignatureError(ImageError):
    """A card image's signature is missing, made by an untrusted key, or does not verify."""

    code = ErrorCode.BAD_SIGNATURE


class StoreFullError(ExstillError):
    """The card's image store has no room for another target (or for this image)."""

    code = ErrorCode.STORE_FULL


class NotAuthorizedError(ExstillError):
    """The card wants proof of its admin key for this request (image-store operations on a
    network link, or any request from beyond loopback): pass the key file (exstill-flash --key,
    open_card(url, key=...)); a wrong key is refused the same way."""

    code = ErrorCode.NOT_AUTHORIZED


class NoImageStoreError(ExstillError):
    """The card has no image store (its HELLO lacks IMAGE_STORE), so it cannot take, list or
    change flashed images; an emulator gets one with ``exstill-emu --store DIR``."""

    code = ErrorCode.UNKNOWN_OPCODE


class StoreError(ExstillError):
    """The card's image store itself is unreadable (its journal is not one); the message names
    the file and what to do."""


class DowngradeRefusedError(ExstillError):
    """The image is older than the target's confirmed image; flash with --allow-downgrade."""

    code = ErrorCode.DOWNGRADE_REFUSED


class ChunkError(ExstillError):
    """An upload chunk arrived corrupted or out of place; the uploader re-sends from the
    offset the card names."""

    code = ErrorCode.BAD_CHUNK


class TransportError(ExstillError, OSError):
    """The link to the card failed."""

    code = ErrorCode.LINK


class LinkTimeoutError(TransportError, TimeoutError):
    """No reply came before the deadline."""

    code = ErrorCode.TIMEOUT


class DeviceNotFoundError(TransportError):
    code = ErrorCode.DEVICE_NOT_FOUND


class DeviceLostError(TransportError):
    """The card reset or vanished: whatever was in flight is lost. ``Card.reconnect()``
    restores the link (the card's streams are gone; SpeculativeDecoder re-opens its own)."""

    code = ErrorCode.DEVICE_LOST


class DeviceBusyError(TransportError):
    """Another process (or a kernel driver) holds the card."""

    code = ErrorCode.DEVICE_BUSY


class DevicePermissionError(TransportError, PermissionError):
    code = ErrorCode.PERMISSION


class BadURLError(ExstillError, ValueError):
    code = ErrorCode.BAD_URL


class TokenizerMismatchError(ExstillError):
    """The target's tokenizer (or vocabulary) is not the one the card's image was made for:
    its drafts would be token ids of another vocabulary."""

    code = ErrorCode.TOKENIZER_MISMATCH


class TargetOutputError(ExstillError):
    """A target adapter returned logits of the wrong shape, or NaN/infinite values."""

    code = ErrorCode.BAD_TARGET_OUTPUT


_CLASS_FOR_CODE: dict[int, type[ExstillError]] = {
    ErrorCode.BAD_FRAME: ProtocolError,
    ErrorCode.UNSUPPORTED_VERSION: ProtocolError,
    ErrorCode.UNKNOWN_OPCODE: ProtocolError,
    ErrorCode.BAD_PAYLOAD: ProtocolError,
    ErrorCode.HANDSHAKE_REQUIRED: ProtocolError,
    ErrorCode.BAD_HANDLE: StreamHandleError,
    ErrorCode.CARD_FULL: CardFullError,
    ErrorCode.K_OUT_OF_RANGE: InvalidArgumentError,
    ErrorCode.CONTEXT_FULL: ContextFullError,
    ErrorCode.UNKNOWN_MODEL: UnknownModelError,
    ErrorCode.BAD_ARGUMENT: InvalidArgumentError,
    ErrorCode.INTERNAL: CardInternalError,
    ErrorCode.BAD_IMAGE: ImageError,
    ErrorCode.BAD_SIGNATURE: ImageSignatureError,
    ErrorCode.STORE_FULL: StoreFullError,
    ErrorCode.DOWNGRADE_REFUSED: DowngradeRefusedError,
    ErrorCode.BAD_CHUNK: ChunkError,
    ErrorCode.NOT_AUTHORIZED: NotAuthorizedError,
    ErrorCode.TIMEOUT: LinkTimeoutError,
    ErrorCode.LINK: TransportError,
    ErrorCode.DEVICE_NOT_FOUND: DeviceNotFoundError,
    ErrorCode.DEVICE_LOST: DeviceLostError,
    ErrorCode.DEVICE_BUSY: DeviceBusyError,
    ErrorCode.PERMISSION: DevicePermissionError,
    ErrorCode.BAD_URL: BadURLError,
    ErrorCode.TOKENIZER_MISMATCH: TokenizerMismatchError,
    ErrorCode.BAD_TARGET_OUTPUT: TargetOutputError,
}


def error_for_code(code: int, message: str) -> ExstillError:
    """The exception for an error code, as received in an ERROR reply."""
    try:
        known = ErrorCode(code)
    except ValueError:
        return CardInternalError(f"card error 0x{code:02x}: {message}")
    return _CLASS_FOR_CODE[known](message, known)
