"""Flashing a card image: check it here, upload (resuming after a dropped link), let the card
verify it, put it on trial, run a health check, confirm.

The upload is pipelined: up to ``window`` chunks are in flight, each with its CRC-32, so the
link stays busy while the card writes. The card names the offset to send from (UPLOAD_BEGIN
answers it for an upload it already holds part of, keyed by the image's SHA-256), so after a
dropped link the next attempt re-sends only what the card did not get; a chunk the card finds
corrupted or out of place is re-sent from the card's offset.
"""

from __future__ import annotations

import contextlib
import hashlib
import struct
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from zlib import crc32

from exstill_sdk.card import Card
from exstill_sdk.errors import (
    ChunkError,
    DeviceLostError,
    ExstillError,
    LinkTimeoutError,
    TransportError,
)
from exstill_sdk.image import open_image
from exstill_sdk.protocol import messages as m
from exstill_sdk.protocol.constants import Opcode

WINDOW = 16
ATTEMPTS = 5


@dataclass
class FlashResult:
    target: str
    version: str
    size: int
    file_sha256: str
    """SHA-256 of the whole image file, as the card's image list shows it."""
    bytes_sent: int
    resent_bytes: int
    """Bytes sent more than once (after a dropped link or a corrupted chunk)."""
    resumed_from: list[int]
    """The offsets uploads resumed from: the card's offset when it already held part of this
    image (an earlier, interrupted flash), then one per reconnect."""
    upload_s: float
    confirmed: bool

    @property
    def mb_per_s(self) -> float:
        return self.size / 1e6 / self.upload_s if self.upload_s else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "mb_per_s": round(self.mb_per_s, 1)}


def file_digest(path: Path) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.digest()


def upload(
    card: Card,
    path: Path,
    req: m.UploadBegin,
    *,
    window: int = WINDOW,
    chunk_size: int | None = None,
    progress: Callable[[int], None] | None = None,
    on_chunk: Callable[[int], None] | None = None,
) -> tuple[int, int, list[int]]:
    """Send the file; (bytes sent, bytes re-sent, offsets resumed from). Reconnects after a
    dropped link (``ATTEMPTS`` times). ``on_chunk(offset)`` is a test hook called before each
    chunk is sent."""
    sent = resent = 0
    resumed: list[int] = []
    high = 0  # highest offset ever sent: anything sent below it again is re-sent
    with open(path, "rb") as f:
        for attempt in range(ATTEMPTS):
            try:
                offset, max_chunk = card.upload_begin(req)
                max_chunk = min(max_chunk, chunk_size or max_chunk)
                if attempt or offset:
                    resumed.append(offset)
                inflight: deque[tuple[int, int]] = deque()
                pos = offset
                while pos < req.size or inflight:
                    while pos < req.size and len(inflight) < window:
                        f.seek(pos)  # chunks are read as sent: an image never sits whole in memory
                        chunk = f.read(max_chunk)
                        if on_chunk is not None:
                            on_chunk(pos)
                        payload = m.UPLOAD_CHUNK_HEAD.pack(pos, crc32(chunk)) + chunk
                        inflight.append((card.send_pipelined(Opcode.UPLOAD_CHUNK, payload), pos))
                        sent += len(chunk)
                        resent += max(0, min(high, pos + len(chunk)) - pos)
                        pos += len(chunk)
                        high = max(high, pos)
                    rid, _ = inflight.popleft()
                    try:
                        done = struct.unpack(
                            "<Q", card.receive_pipelined(rid, Opcode.UPLOAD_CHUNK)
                        )[0]
                    except ChunkError:
                        for other, _ in inflight:  # their replies are errors too: collect them
                            with contextlib.suppress(ChunkError):
                                card.receive_pipelined(other, Opcode.UPLOAD_CHUNK)
                        inflight.clear()
                        pos, _ = card.upload_begin(req)  # the card's offset
                        continue
                    if progress is not None:
                        progress(done)
                return sent, resent, resumed
            except (DeviceLostError, LinkTimeoutError, TransportError):
                if attempt + 1 == ATTEMPTS:
                    raise
                time.sleep(0.2 * (attempt + 1))
                card.reconnect()
    raise AssertionError("unreachable")


def flash(
    card: Card,
    image_path: str | Path,
    *,
    target: str | None = None,
    confirm: bool = True,
    allow_downgrade: bool = False,
    progress: Callable[[int], None] | None = None,
    health_check: bool = True,
    window: int = WINDOW,
    chunk_size: int | None = None,
    on_chunk: Callable[[int], None] | None = None,
) -> FlashResult:
    """Flash an image and return what happened. ``window`` chunks are kept in flight (1 makes
    a dropped link cost at most one chunk of re-sending; more keeps a fast link busy);
    ``chunk_size`` caps the chunk below the card's maximum (1 MiB)."""
    path = Path(image_path)
    with open_image(path, verify=True) as image:  # refuse a bad image before sending a byte
        name = target or image.target
        version = image.image_version
    size = path.stat().st_size
    digest = file_digest(path)
    req = m.UploadBegin(size, digest, name, version, allow_downgrade)
    start = time.perf_counter()
    sent, resent, resumed = upload(
        card,
        path,
        req,
        window=window,
        chunk_size=chunk_size,
        progress=progress,
        on_chunk=on_chunk,
    )
    upload_s = time.perf_counter() - start
    card.upload_end(timeout=max(card.timeout, 120))
    card.activate(name)
    if health_check:
        try:
            with card.open_stream(target=name) as stream:
                stream.prefill([1, 2, 3, 4])
                stream.draft(2)
        except ExstillError:
            card.revert(name)
            raise
    if confirm:
        card.confirm(name)
    return FlashResult(name, version, size, digest.hex(), sent, resent, resumed, upload_s, confirm)
