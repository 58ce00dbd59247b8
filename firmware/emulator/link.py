"""A card's point-to-point host link (serial, USB): one host at a time, no connection events.

Such a link cannot tell that the host process went away, so a HELLO starts a fresh session:
the streams of the previous one are closed, as a card does when its host reboots.
"""

from __future__ import annotations

from exstill_sdk.protocol.constants import Opcode

from ..runtime import CardRuntime


class SingleHostLink:
    def __init__(self, runtime: CardRuntime, name: str) -> None:
        self.runtime = runtime
        self.name = name
        self.session = runtime.open_session(name)

    def handle(self, frame: bytes) -> bytes | None:
        if len(frame) > 1 and frame[1] == Opcode.HELLO:
            self.runtime.close_session(self.session)
            self.session = self.runtime.open_session(self.name)
        return self.runtime.handle(self.session, frame)

    def close(self) -> None:
        self.runtime.close_session(self.session)
