"""The public card interface: what the speculative-decoding layer, the adapters and the tools
ask of a card.

``Card`` (card.py, one card over one link) implements it, and so does ``CardPool`` (pool.py,
several cards presented as one). It is a ``typing.Protocol``: an implementation need not
inherit from it, and mypy checks every place that passes a ``Card`` where a
``CardInterface`` is expected.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

from exstill_sdk.protocol import messages as m
from exstill_sdk.protocol.constants import Features, WireMode
from exstill_sdk.stream import DraftStream


@dataclass(frozen=True)
class CardInfo:
    """What a card says about itself in the handshake."""

    protocol_version: int
    firmware: str
    slots: int
    context: int
    max_k: int
    wire_modes: tuple[WireMode, ...]
    features: Features
    max_payload: int
    engines: tuple[str, ...]
    targets: tuple[m.TargetInfo, ...]


class CardInterface(Protocol):
    """A card as its users see it: the handshake's facts, streams, and rounds of several
    streams sent together. Each stream talks over its own card's link (its RequestPath)."""

    @property
    def url(self) -> str: ...

    def info(self) -> CardInfo: ...

    def stats(self) -> dict[str, int]: ...

    def open_stream(
        self,
        engine: str | None = None,
        *,
        target: str | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        max_k: int | None = None,
        wire_mode: WireMode = WireMode.TOKENS,
        long_context: bool = False,
        lookup: bool = False,
    ) -> DraftStream: ...

    def sent_together(self) -> AbstractContextManager[None]:
        """Requests sent inside go out in one write when the block ends, so that the card
        reads them together and drafts their misses as one batch."""
        ...

    def reconnect(self) -> None: ...

    def close(self) -> None: ...
