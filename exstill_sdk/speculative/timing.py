"""Timing a verification pass and the host's round beside it, one way for every caller: the
decoder times the target's call, a serving engine's drafter the time between two of its calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

Clock = Callable[[], float]


class PassTiming(NamedTuple):
    """One target pass and the host's round before it (the round that drafted what the pass
    scored)."""

    tokens: int
    """Tokens the pass scored: every sequence's draft and one more each."""
    pass_s: float
    """Seconds the target took."""
    round_s: float | None
    """Seconds of the round before the pass (acceptance, the card, the host); None when that
    round is unknown (the first pass, or the first after a change of planner or a burst of the
    target alone)."""
    card_s: float
    """The part of ``round_s`` spent waiting for the card."""
    drafted: int | None
    """Tokens the card drafted in that round; None when it also brought a stream up to date,
    which is not what drafting costs."""
    steady: bool
    """The pass scored drafts only (no prompt in it)."""


class PassClock:
    """Times the alternation of host rounds and target passes.

    ``begin_pass`` ends a round and starts a pass, ``end_pass`` ends the pass (and starts the
    next round) and returns its ``PassTiming``; ``card`` records the round's card work. A
    serving engine that runs the pass between two calls ends the pass when it calls again.
    """

    def __init__(self, clock: Clock = time.perf_counter) -> None:
        self.now = clock
        self._round_start: float | None = None
        self._pass_start = 0.0
        self._tokens = 0
        self._round: tuple[float, float, int | None] | None = None
        """The last round: its seconds, the card's share, tokens drafted."""
        self._card: tuple[float, int | None] = (0.0, None)

    def begin_pass(self, tokens: int) -> float:
        """A pass of ``tokens`` tokens starts now (the round before it is over)."""
        now = self._pass_start = self.now()
        self._tokens = tokens
        if self._round_start is not None:
            self._round = (now - self._round_start, *self._card)
        self._card = (0.0, None)
        return now

    def end_pass(self, steady: bool, now: float | None = None) -> PassTiming:
        """The pass ended (``now``, or the clock's time): its timing with the round before."""
        now = self.now() if now is None else now
        last, self._round = self._round, None
        self._round_start = now
        pass_s = now - self._pass_start
        if last is None:
            return PassTiming(self._tokens, pass_s, None, 0.0, None, steady)
        return PassTiming(self._tokens, pass_s, *last, steady)

    def card(self, seconds: float, drafted: int | None) -> None:
        """The round waited ``seconds`` for the card, which drafted ``drafted`` tokens (None:
        it also brought a stream up to date)."""
        self._card = (seconds, drafted)

    def reset(self) -> None:
        """Forget the round in progress: the next pass's timing has no round before it."""
        self._round_start = self._round = None
