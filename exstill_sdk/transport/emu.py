"""``emu://``: the card runtime in this process, behind the same frames as a real link.

Query parameters: ``streams`` (slots, default 12), ``context`` (tokens per slot, 16384),
``engine`` (comma-separated built-in engines, ``lookup``), ``image`` (comma-separated card image
paths, one target each), ``max_k`` (16), ``prefetch`` (1/0), ``outcomes`` (1/0: prefetch for
other verification outcomes too, not only full acceptance), ``threads`` (compute threads of
the transformer engines; 0, the default, lets onnxruntime use every core; 1 leaves the other
cores to the host, as a card's own silicon would).
A request is served inside ``send_frame`` on the caller's thread: no socket and no thread
hand-off on the per-round path; requests sent together (``Card.sent_together``) are served as one
read is on the other links (``CardRuntime.handle_many``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING
from urllib.parse import SplitResult

from exstill_sdk.errors import BadURLError, InvalidArgumentError, LinkTimeoutError
from exstill_sdk.transport.base import Transport, int_param, query_params

if TYPE_CHECKING:
    from exstill_firmware import CardRuntime


class EmuTransport(Transport):
    scheme = "emu"

    def __init__(self, runtime: CardRuntime, owns_runtime: bool = False) -> None:
        self.runtime = runtime
        self._session = runtime.open_session("emu")
        self._owns = owns_runtime
        self._inbox: deque[bytes] = deque()
        self._closed = False

    @classmethod
    def from_url(cls, url: SplitResult, timeout: float) -> EmuTransport:
        from exstill_firmware.emulator import CardOptions, build_runtime

        if url.netloc or url.path not in ("", "/"):
            raise BadURLError(f"{url.geturl()!r}: the emulator URL is emu:// with ?options")
        params = query_params(url)
        card = CardOptions()
        options = CardOptions(
            slots=int_param(params, "streams", card.slots),
            context=int_param(params, "context", card.context),
            max_k=int_param(params, "max_k", card.max_k),
            prefetch=bool(int_param(params, "prefetch", int(card.prefetch))),
            prefetch_outcomes=bool(int_param(params, "outcomes", int(card.prefetch_outcomes))),
            threads=int_param(params, "threads", card.threads),
            store=params.pop("store", None),
            engines=tuple(params.pop("engine", ",".join(card.engines)).split(",")),
            images=tuple(p for p in params.pop("image", "").split(",") if p),
        )
        if params:
            raise BadURLError(
                f"unknown emu:// option(s) {', '.join(params)}; known: streams, context, "
                "engine, image, store, max_k, prefetch, outcomes, threads"
            )
        try:
            return cls(build_runtime(options), owns_runtime=True)
        except InvalidArgumentError as exc:
            raise BadURLError(str(exc)) from None

    def send_frame(self, frame: bytes) -> None:
        reply = self.runtime.handle(self._session, frame)
        if reply is not None:
            self._inbox.append(reply)

    def send_frames(self, frames: Sequence[bytes]) -> None:
        """Frames sent together are served together, as a byte-stream link's card serves the
        frames of one read: the misses among a batch's COMMITs are drafted as one batch."""
        self._inbox.extend(self.runtime.handle_many(self._session, frames))

    def recv_frame(self, deadline: float) -> bytes:
        try:
            return self._inbox.popleft()
        except IndexError:
            # Requests are served synchronously: no reply now means the card dropped the frame.
            raise LinkTimeoutError(
                "the emulated card sent no reply (it drops frames that fail the CRC or length "
                "check)"
            ) from None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.runtime.close_session(self._session)
        if self._owns:
            self.runtime.shutdown()
