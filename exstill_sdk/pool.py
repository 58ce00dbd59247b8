"""Several cards as one: ``open_cards("tcp://a:7000,tcp://b:7000")`` gives a ``CardPool``.

The pool is a ``CardInterface``, so the decoder and the vLLM proposer take it as they take one
card. Each stream lives on one member card and talks over that card's link; the pool decides
where it goes and keeps count:

- *Placement*: a new stream goes to the least-loaded card (open streams over slots) that holds
  its target or engine; ties go round-robin. A card without it is skipped; a full card passes
  the stream on to the next.
- *Capacity*: ``info()`` sums the members' streams; context, K and frame size are the
  smallest member's, features and wire modes those all members have.
- *Failure*: a card whose link drops costs only its own streams: ``reconnect()`` (what the
  decoder calls after DeviceLostError) reconnects the cards that were lost, or sets them aside,
  and closes their streams; the caller reopens those on the cards still up, from its own
  context. A card set aside is tried again at most every ``rejoin_s`` seconds and rejoins
  when it answers.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from exstill_sdk.card import DEFAULT_TIMEOUT, Card, open_card
from exstill_sdk.errors import (
    BadURLError,
    CardFullError,
    DeviceLostError,
    ExstillError,
    InvalidArgumentError,
    LinkTimeoutError,
    UnknownModelError,
)
from exstill_sdk.interface import CardInfo, CardInterface
from exstill_sdk.protocol import messages as m
from exstill_sdk.protocol.constants import Opcode, WireMode
from exstill_sdk.stream import DraftStream

log = logging.getLogger(__name__)

REJOIN_S = 2.0
"""How often a card set aside is tried again (seconds)."""

PROBE_TIMEOUT = 1.0
"""The longest a reconnect waits on each card to learn whether it is still there."""

_NEXT_URL = re.compile(r",\s*(?=[A-Za-z][A-Za-z0-9+.-]+:)")
"""A comma that starts another card's URL (a comma inside one, as in emu://?engine=a,b, is
followed by no scheme)."""


def split_card_urls(url: str) -> list[str]:
    """The card URLs of a pool URL (``URL,URL,...``); one URL gives a list of one."""
    urls = [u.strip() for u in _NEXT_URL.split(url)]
    if not all(urls):
        raise BadURLError(f"{url!r}: a pool of cards is URLs separated by commas, none empty")
    return urls


@dataclass(eq=False)
class Member:
    """One card of the pool, up (``card``) or set aside (``card`` None, ``why``)."""

    url: str
    card: Card | None = None
    why: str = ""
    tried: float = 0.0
    """When it was last (re)connected or tried."""
    streams: weakref.WeakSet[DraftStream] = field(default_factory=weakref.WeakSet)
    placed: int = 0
    """Streams placed on it so far."""
    lost: int = 0
    """Times it was lost and set aside or reconnected."""

    def load(self) -> float:
        """Open streams over slots."""
        assert self.card is not None
        return sum(not s.closed for s in self.streams) / max(1, self.card.info().slots)

    def holds(self, kind: str, name: str) -> bool:
        assert self.card is not None
        info = self.card.info()
        if kind == "engine":
            return name in info.engines
        return any(t.name == name for t in info.targets)


class CardPool:
    """Cards presented as one card (module docstring). Use as a context manager, or call
    ``close``."""

    def __init__(
        self,
        urls: list[str],
        timeout: float = DEFAULT_TIMEOUT,
        trace: bool = False,
        key: str | Path | bytes | None = None,
        rejoin_s: float = REJOIN_S,
    ) -> None:
        """Connects to every card; a card that does not answer is set aside (and tried again
        later), unless none answers."""
        if len(set(urls)) != len(urls):
            raise BadURLError(f"a card is named twice in the pool: {', '.join(urls)}")
        self.timeout = timeout
        self.rejoin_s = rejoin_s
        self._trace, self._key = trace, key
        self.members = [Member(u) for u in urls]
        self._turn = itertools.count()
        self._info: CardInfo | None = None
        self._closed = False
        self._lock = threading.RLock()
        """Held while membership changes or a stream is placed: the decoders of several threads
        may share a pool, and several of them see a card go at once."""
        errors = []
        for member in self.members:
            try:
                self._connect(member)
            except ExstillError as exc:
                errors.append(exc)
        if not self.up:
            self.close()
            raise errors[0]

    # ------------------------------------------------------------ membership

    @property
    def url(self) -> str:
        return ",".join(member.url for member in self.members)

    @property
    def up(self) -> list[Member]:
        return [member for member in self.members if member.card is not None]

    def _cards(self) -> list[tuple[Member, Card]]:
        """The members up, with their cards."""
        return [(member, member.card) for member in self.members if member.card is not None]

    def _connect(self, member: Member) -> None:
        member.tried = time.monotonic()
        try:
            card = open_card(member.url, self.timeout, self._trace, self._key)
        except ExstillError as exc:
            self._set_aside(member, exc)
            raise
        problem = self._conflict(card)
        if problem:
            card.close()
            refused = InvalidArgumentError(problem)
            self._set_aside(member, refused)
            raise refused
        member.card, member.why = card, ""
        self._info = None
        log.info("card %s joined the pool", member.url)

    def _conflict(self, card: Card) -> str:
        """Why the card cannot join: a target named as one a member holds, packed for another
        tokenizer or vocabulary (a stream placed on either must draft the same tokens)."""
        mine = {t.name: t for _, up in self._cards() for t in up.info().targets}
        for t in card.info().targets:
            other = mine.get(t.name)
            if other is not None and (
                other.tokenizer_sha256 != t.tokenizer_sha256 or other.vocab_size != t.vocab_size
            ):
                return (
                    f"{card.url} holds a target {t.name!r} packed for another tokenizer than the "
                    "pool's other cards: flash the same image on every card of a pool"
                )
        return ""

    def _set_aside(self, member: Member, exc: BaseException) -> None:
        """The member is lost: its streams are closed, it is out of placement until it
        rejoins."""
        if member.card is not None:
            member.lost += 1
            for stream in list(member.streams):
                stream.mark_lost()
            with contextlib.suppress(ExstillError, OSError):
                member.card.close()
            log.warning("card %s left the pool: %s", member.url, exc)
        member.card = None
        member.why = str(exc)
        member.streams = weakref.WeakSet()
        self._info = None

    def rejoin(self, force: bool = False) -> int:
        """Try the cards set aside (each at most every ``rejoin_s`` seconds, unless
        ``force``); returns how many joined again."""
        joined = 0
        with self._lock:
            now = time.monotonic()
            for member in self.members:
                if member.card is None and (force or now - member.tried >= self.rejoin_s):
                    with contextlib.suppress(ExstillError):
                        self._connect(member)
                        joined += 1
        return joined

    def reconnect(self) -> None:
        """After a DeviceLostError: each card is asked whether it is still there; a card that
        is not is reconnected (a card that restarted forgets its streams) or set aside, and
        either way its streams are closed. Cards set aside are tried again. Raises
        DeviceLostError when no card is up."""
        with self._lock:
            self._closed = False
            for member, card in self._cards():
                try:
                    card.request(Opcode.PING, timeout=min(self.timeout, PROBE_TIMEOUT))
                    continue
                except (DeviceLostError, LinkTimeoutError):
                    pass
                try:
                    member.lost += 1
                    member.tried = time.monotonic()
                    card.reconnect()  # closes its streams
                    member.streams = weakref.WeakSet()
                    self._info = None
                except ExstillError as exc:
                    member.lost -= 1  # counted once, by _set_aside
                    self._set_aside(member, exc)
            self.rejoin()
        if not self.up:
            why = "; ".join(f"{member.url}: {member.why}" for member in self.members)
            raise DeviceLostError(f"no card of the pool answers: {why}")

    # ------------------------------------------------------------ the card interface

    def info(self) -> CardInfo:
        """The pool as one card: streams summed over the cards up; per-stream limits the
        smallest card's; targets and engines any card holds."""
        if self._info is None:
            infos = [card.info() for _, card in self._cards()]
            if not infos:
                raise DeviceLostError("no card of the pool is up; reconnect() when one is back")
            first = infos[0]
            features = first.features
            modes = set(first.wire_modes)
            targets: dict[str, m.TargetInfo] = {}
            engines: dict[str, None] = {}
            for info in infos:
                features &= info.features
                modes &= set(info.wire_modes)
                for t in info.targets:
                    targets.setdefault(t.name, t)
                engines.update(dict.fromkeys(info.engines))
            self._info = replace(
                first,
                protocol_version=min(i.protocol_version for i in infos),
                firmware=", ".join(dict.fromkeys(i.firmware for i in infos)),
                slots=sum(i.slots for i in infos),
                context=min(i.context for i in infos),
                max_k=min(i.max_k for i in infos),
                wire_modes=tuple(w for w in first.wire_modes if w in modes),
                features=features,
                max_payload=min(i.max_payload for i in infos),
                engines=tuple(engines),
                targets=tuple(targets.values()),
            )
        return self._info

    def stats(self) -> dict[str, int]:
        """The counters of the cards up, summed (per card: ``member_stats``)."""
        total: dict[str, int] = {}
        for stats in self.member_stats().values():
            for name, value in stats.items():
                total[name] = total.get(name, 0) + value
        return total

    def member_stats(self) -> dict[str, dict[str, int]]:
        """Each card's counters, by URL (cards set aside are left out)."""
        return {member.url: card.stats() for member, card in self._cards()}

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
    ) -> DraftStream:
        """A stream on the least-loaded card that holds the target (or engine); see
        ``Card.open_stream`` for the parameters."""
        with self._lock:
            return self._open_stream(
                engine,
                target,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                seed=seed,
                max_k=max_k,
                wire_mode=wire_mode,
                long_context=long_context,
                lookup=lookup,
            )

    def _open_stream(self, engine: str | None, target: str | None, **options: Any) -> DraftStream:
        if self._closed:
            raise ExstillError("this CardPool is closed; open_cards() again")
        self.rejoin()
        if engine is not None and target is not None:
            raise InvalidArgumentError("open a stream on an engine or on a target, not both")
        if target is None and engine is None:
            engines = self.info().engines
            if not engines:
                raise UnknownModelError("no card of the pool has a built-in engine; name a target")
            engine = engines[0]
        kind, name = ("target", target) if target is not None else ("engine", engine)
        assert name is not None
        holders = [member for member in self.up if member.holds(kind, name)]
        if not holders:
            raise UnknownModelError(
                f"no card of the pool holds the {kind} {name!r}; flash it with exstill-flash"
            )
        turn = next(self._turn)
        order = sorted(
            range(len(holders)), key=lambda i: (holders[i].load(), (i - turn) % len(holders))
        )
        full: ExstillError | None = None
        for i in order:
            member = holders[i]
            assert member.card is not None
            try:
                stream = member.card.open_stream(engine, target=target, **options)
            except CardFullError as exc:
                full = exc
                continue
            except DeviceLostError as exc:
                self._set_aside(member, exc)
                continue
            member.streams.add(stream)
            member.placed += 1
            return stream
        if full is None:
            raise DeviceLostError(f"every card of the pool that holds {name!r} was lost")
        raise CardFullError(
            f"every stream of the {len(holders)} card(s) that hold {name!r} is in use; close "
            "one, or add a card to the pool"
        )

    @contextlib.contextmanager
    def sent_together(self) -> Iterator[None]:
        """Each card's requests sent inside go out in one write to that card."""
        with contextlib.ExitStack() as stack:
            for _, card in self._cards():
                stack.enter_context(card.sent_together())
            yield

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True
        for member in self.members:
            if member.card is not None:
                member.card.close()

    def __enter__(self) -> CardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_cards(
    url: str = "emu://",
    timeout: float = DEFAULT_TIMEOUT,
    trace: bool = False,
    key: str | Path | bytes | None = None,
) -> CardInterface:
    """A card, or a pool of cards when ``url`` lists several (``URL,URL,...``): what the
    decoder and the vLLM proposer take. ``open_card`` gives one card with all its requests."""
    urls = split_card_urls(url)
    if len(urls) == 1:
        return open_card(urls[0], timeout, trace, key)
    return CardPool(urls, timeout, trace, key)


__all__ = ["CardPool", "Member", "open_cards", "split_card_urls"]
