"""The card's image store as the host asks it: upload (begin, chunks, end), activate, confirm,
revert, erase, list. A card without a store says so in its handshake (Features.IMAGE_STORE), and
these requests are refused here with NoImageStoreError. exstill_sdk/flash.py drives them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from exstill_sdk.errors import NoImageStoreError
from exstill_sdk.protocol import messages as m
from exstill_sdk.protocol.constants import Features, Opcode


class _Handshake(Protocol):
    @property
    def features(self) -> Features: ...


class ImageStoreRequests:
    """Mixed into Card: the image-store requests, over the card's own request path."""

    timeout: float

    if TYPE_CHECKING:  # what Card provides

        @property
        def url(self) -> str: ...

        def info(self) -> _Handshake: ...

        def request(
            self,
            opcode: Opcode,
            payload: bytes = b"",
            handle: int = 0,
            timeout: float | None = None,
        ) -> bytes: ...

    def _store_request(
        self, opcode: Opcode, payload: bytes = b"", timeout: float | None = None
    ) -> bytes:
        """An image-store request, refused here when the card said it has no store."""
        if not self.info().features & Features.IMAGE_STORE:
            raise NoImageStoreError(
                f"{self.url or 'this card'} has no image store, so it cannot take, list or "
                "change flashed images; start the emulator with --store DIR"
            )
        return self.request(opcode, payload, timeout=timeout)

    def upload_begin(self, req: m.UploadBegin) -> tuple[int, int]:
        """Start or resume an upload: (offset to send from, largest chunk)."""
        offset, max_chunk = m.UPLOAD_BEGIN_REPLY.unpack(
            self._store_request(Opcode.UPLOAD_BEGIN, m.encode_upload_begin(req))
        )
        return offset, max_chunk

    def upload_end(self, timeout: float | None = None) -> bytes:
        """Finish the upload; the card checks it in full. Returns the digest it verified."""
        return self._store_request(Opcode.UPLOAD_END, b"", timeout=timeout)

    def activate(self, target: str) -> None:
        """Serve the newly uploaded image of ``target`` on trial (until confirmed)."""
        self._store_request(Opcode.ACTIVATE, m.encode_name(target), timeout=max(self.timeout, 60))

    def confirm(self, target: str) -> None:
        self._store_request(Opcode.CONFIRM, m.encode_name(target))

    def revert(self, target: str) -> None:
        """Drop the image on trial, or go back to the previously confirmed one."""
        self._store_request(Opcode.REVERT, m.encode_name(target), timeout=max(self.timeout, 60))

    def erase(self, target: str) -> None:
        self._store_request(Opcode.ERASE, m.encode_name(target))

    def list_images(self) -> list[m.ImageEntry]:
        return m.decode_image_list(self._store_request(Opcode.LIST_IMAGES))
