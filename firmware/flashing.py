"""The runtime's image-store requests: upload (begin, chunks, end), activate, confirm,
revert, list and erase. Serving targets follow the store: ACTIVATE and REVERT load the
image that now serves; streams already open keep the engine they were opened on."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from exstill_sdk.errors import InvalidArgumentError
from exstill_sdk.image import open_image
from exstill_sdk.protocol import messages as m
from exstill_sdk.protocol.constants import MAX_PAYLOAD, Opcode

from .engines import DraftEngine
from .store import SLOTS, Store
from .telemetry import Telemetry

if TYPE_CHECKING:
    from .streams import Session

MAX_CHUNK = MAX_PAYLOAD - m.UPLOAD_CHUNK_HEAD.size
log = logging.getLogger(__name__)


class StoreService:
    def __init__(
        self,
        models: dict[str, DraftEngine],
        telemetry: Telemetry,
        store: Store,
        make_engine: Callable[[Path, str], DraftEngine],
    ) -> None:
        """``models``: the runtime's engines and targets by name, which this service changes
        as images are activated, reverted and erased."""
        self.models = models
        self.store = store
        self.make_engine = make_engine
        self.builtin = frozenset(models)
        """The card's own engines: no stored target may take one of their names."""
        refused = 0
        for name, path in store.serving().items():
            if name in self.builtin:  # flashed before names were checked: never served
                log.warning("stored target %r has a built-in engine's name; not served", name)
                refused += 1
                continue
            self._boot_serve(name, path)
        telemetry.images_set_aside = refused + sum(map(len, store.damaged.values()))

    def _boot_serve(self, name: str, path: Path | None) -> None:
        """Serve a target's image at boot; one that does not load is set aside for the other
        slot's, and a target with none left does not serve: the card serves the rest."""
        while path is not None:
            try:
                self._serve(name, path)
                return
            except Exception:
                log.exception("target %r: %s does not load; set aside", name, path.name)
                path = self.store.set_aside(name)

    def _serve(self, name: str, path: Path | None) -> None:
        if path is None:
            self.models.pop(name, None)
        else:
            self.models[name] = self.make_engine(path, name)

    def handlers(self) -> dict[int, Callable[[Session, int, bytes], bytes]]:
        return {
            Opcode.UPLOAD_BEGIN: self._begin,
            Opcode.UPLOAD_CHUNK: self._chunk,
            Opcode.UPLOAD_END: self._end,
            Opcode.ACTIVATE: self._activate,
            Opcode.CONFIRM: self._confirm,
            Opcode.REVERT: self._revert,
            Opcode.LIST_IMAGES: self._list,
            Opcode.ERASE: self._erase,
        }

    def _begin(self, session: Session, handle: int, payload: bytes) -> bytes:
        req = m.decode_upload_begin(payload)
        if req.target in self.builtin:
            raise InvalidArgumentError(
                f"{req.target!r} is the name of the card's built-in engine; flash the image "
                "under another target name (--target)"
            )
        offset = self.store.begin(
            req.target, req.size, req.sha256, req.version, req.allow_downgrade
        )
        return m.UPLOAD_BEGIN_REPLY.pack(offset, MAX_CHUNK)

    def _chunk(self, session: Session, handle: int, payload: bytes) -> bytes:
        head = m.UPLOAD_CHUNK_HEAD
        if len(payload) < head.size:
            raise m._bad("UPLOAD_CHUNK shorter than its header")
        offset, crc = head.unpack_from(payload)
        return m.U64.pack(self.store.chunk(offset, memoryview(payload)[head.size :], crc))

    def _end(self, session: Session, handle: int, payload: bytes) -> bytes:
        if payload:
            raise m._bad("UPLOAD_END takes no payload")
        return self.store.end()

    def _activate(self, session: Session, handle: int, payload: bytes) -> bytes:
        name = m.decode_name(payload)
        path = self.store.activate(name)
        try:
            self._serve(name, path)
        except Exception:
            self.store.revert(name)  # an image the engine cannot run does not stay on trial
            raise
        return b""

    def _confirm(self, session: Session, handle: int, payload: bytes) -> bytes:
        self.store.confirm(m.decode_name(payload))
        return b""

    def _revert(self, session: Session, handle: int, payload: bytes) -> bytes:
        name = m.decode_name(payload)
        self._serve(name, self.store.revert(name))
        return b""

    def _list(self, session: Session, handle: int, payload: bytes) -> bytes:
        entries = [
            m.ImageEntry(target, slot, state, version, size, digest)
            for target, slot, state, version, size, digest in self.store.entries()
        ]
        return m.encode_image_list(entries)

    def _erase(self, session: Session, handle: int, payload: bytes) -> bytes:
        name = m.decode_name(payload)
        self.store.erase(name)
        self.models.pop(name, None)
        return b""


def transformer_factory(
    slots: int, context: int, threads: int = 0
) -> Callable[[Path, str], DraftEngine]:
    """Engines for store images: the transformer engine, named after the store's target."""

    def make(path: Path, name: str) -> DraftEngine:
        from .engines.transformer import TransformerEngine

        engine = TransformerEngine(open_image(path), rows=slots, positions=context, threads=threads)
        engine.name = name
        return engine

    return make


__all__ = ["MAX_CHUNK", "SLOTS", "StoreService", "transformer_factory"]
