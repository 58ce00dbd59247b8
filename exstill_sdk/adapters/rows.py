"""One card stream per row of a serving engine's batch, kept in step with the row's tokens.

Serving engines such as vLLM hand a drafter, once per step, the batch as rows: each row's
tokens so far (prompt + output, speculative tokens excluded) and the tokens sampled in the
step. They do not say which request a row holds, and rows move when requests finish (the batch
is compacted) or are preempted. ``RowStreams`` therefore matches by content:

- a row whose tokens extend a stream's context by the stream's last draft's accepted prefix and
  one more token is that stream's request, one round later: one COMMIT (accepted count, bonus,
  next K) brings the next draft, which the card may already have drafted ahead;
- a row whose tokens extend a stream's context otherwise (the first step after the prompt, a
  re-scheduled request) prefills the difference and drafts;
- a row that matches no stream takes a stream that no row wants (rolled back to the longest
  common prefix, then prefilled) or opens one;
- streams that no row in the batch wants are closed.

The rows' COMMITs are sent together, in one write, and their replies collected after, so a
step costs about one round trip to the card, not one per row (and the card drafts the rows
whose draft ahead missed as one batch). Rows beyond the card's streams go without drafts; once
the card has refused a stream, no row asks again until a stream has been closed here or
``RETRY_STEPS`` steps have passed (another host may free one), so a full card is not asked for
a stream every step. A card error on a row drops that row's stream (the row goes on without
drafts until it is re-opened); a lost link reconnects, and the rows whose streams it held go on
without drafts that step (on a pool of cards, only the lost card's). Output never depends on
any of this: the target verifies every drafted token.

With ``planner`` (a ``BatchK``) each row drafts as many tokens as pay for themselves, up to
the engine's K: the engine's step between two calls is the verification pass, timed here by the
tokens in it (every row's draft and one more), and each row's acceptance is counted per
position, so rows whose drafts are seldom accepted draft short or not at all, and a batch that
already fills the target's arithmetic drafts less (exstill_sdk.speculative.batch_k). Steps that
also prefilled a request are not timed: they are not what drafting costs. With ``lookup``,
acceptance is counted apart for the drafts prompt lookup made and those the model made (the
card says which), and a row's next K is planned as if whoever drafted its last draft drafts
the next: a repeat goes on for many rounds, and so does text that does not repeat.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from exstill_sdk.errors import CardFullError, DeviceLostError, ExstillError, InvalidArgumentError
from exstill_sdk.interface import CardInterface
from exstill_sdk.metrics.histogram import Histogram
from exstill_sdk.protocol.constants import WireMode
from exstill_sdk.protocol.drafts import Draft, Verdict
from exstill_sdk.speculative.batch_k import BatchK
from exstill_sdk.speculative.rounds import CatchUp, Commit, exchange
from exstill_sdk.speculative.timing import Clock, PassClock, PassTiming
from exstill_sdk.stream import DraftStream
from exstill_sdk.support.tokens import common_prefix, continues

RETRY_STEPS = 64
"""Steps after the card refused a stream before rows without one ask again, if no stream was
closed here meanwhile."""

log = logging.getLogger(__name__)


@dataclass
class _Tracked:
    stream: DraftStream
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """The context the card's stream holds (committed tokens)."""
    draft: tuple[int, ...] | None = None
    """The stream's pending draft (None: none pending, as after an open or a rollback)."""
    request: int = 0
    """Which request the stream holds, for the planner's per-request acceptance: a new number
    whenever the stream starts on another request."""
    lookup: bool = False
    """Whether prompt lookup drafted the pending draft (Draft.lookup), not the model."""

    def key(self, lookup: bool | None = None) -> int:
        """The planner's sequence: the request and who drafts (``lookup``, default: who drafted
        the pending draft), whose acceptance differs (lookup's drafts of a repeat are long and
        right, the model's shorter)."""
        return 2 * self.request + (self.lookup if lookup is None else lookup)


@dataclass
class RowStats:
    commits: int = 0
    """Rows kept in step with one COMMIT."""
    prefills: int = 0
    """Rows that needed a prefill (new requests, re-synchronised ones)."""
    opened: int = 0
    closed: int = 0
    prefetch_hits: int = 0
    no_stream: int = 0
    """Row-steps without a draft because every stream of the card was taken."""
    errors: int = 0
    """Rows whose stream the card refused or lost (the row went on without a draft)."""
    reconnects: int = 0


class RowStreams:
    """Card streams for the rows of a batch (see the module's docstring).

    ``draft`` names a target image on the card, ``engine`` a built-in engine (used when
    ``draft`` is None). Drafts are greedy token lists (wire mode TOKENS). ``adaptive``: each
    row's K is chosen by a ``BatchK`` (``planner``, made on the first step), up to the engine's
    K; otherwise every row drafts the engine's K. ``lookup``: streams on ``draft`` draft by
    prompt lookup where their text repeats and by the model elsewhere (OpenFlags.LOOKUP); then
    ``model_k`` (1 or more, None for no limit) caps the draft of a row whose last draft was the
    model's: lookup's drafts cost the card nothing and are mostly right, the model's later
    tokens seldom are, and in a pass bound by arithmetic each drafted token costs as much as a
    plain one.
    """

    def __init__(
        self,
        card: CardInterface,
        *,
        draft: str | None = None,
        engine: str | None = None,
        adaptive: bool = False,
        lookup: bool = False,
        model_k: int | None = None,
        clock: Clock = time.perf_counter,
    ) -> None:
        if model_k is not None and model_k < 1:
            raise InvalidArgumentError(
                f"model_k is {model_k}: 1 or more (a row that never drafts never finds a repeat)"
            )
        self.card = card
        self.lookup = lookup
        self.model_k = model_k if lookup else None
        self.draft_target = draft
        self.engine = engine
        self.adaptive = adaptive
        self.planner: BatchK | None = None
        self.stats = RowStats()
        self._rows: dict[int, _Tracked] = {}
        self._refused: tuple[int, int] | None = None
        """(streams closed, step) when the card last refused a stream."""
        self._steps = 0
        self._requests = itertools.count(1)
        self.round_trips = Histogram()
        """Seconds of each step's card half (its COMMITs and catch-ups, sent and answered)."""
        self._clock = PassClock(clock)
        """The engine's pass is the time between two calls; a call is the round."""

    def propose(
        self,
        sampled: Sequence[Sequence[int]],
        lengths: np.ndarray,
        tokens: np.ndarray,
        k: int,
        max_length: int | None = None,
    ) -> list[list[int]]:
        """Drafts for each row: row ``i`` holds ``tokens[i, :lengths[i]]``, of which the last
        ``len(sampled[i])`` were sampled in this step; rows with nothing sampled (still in
        prefill) get no draft. Drafts stop short of ``max_length`` tokens in all."""
        try:
            return self._propose(sampled, lengths, tokens, k, max_length)
        except DeviceLostError as exc:
            log.warning("%s; reconnecting, this step goes without drafts", exc)
            self._rows = {}  # the card forgot every stream
            self._reconnect()
            return [[] for _ in sampled]

    def _propose(
        self,
        sampled: Sequence[Sequence[int]],
        lengths: np.ndarray,
        tokens: np.ndarray,
        k: int,
        max_length: int | None,
    ) -> list[list[int]]:
        started = self._clock.now()
        out: list[list[int]] = [[] for _ in sampled]
        unclaimed = self._rows
        self._rows = {}
        wanted: list[tuple[int, np.ndarray]] = []
        info = self.card.info()
        capacity, k = info.context, min(k, info.max_k)
        for i, new in enumerate(sampled):
            if not len(new):
                if i in unclaimed:  # a row mid-prefill keeps its stream
                    self._rows[i] = unclaimed.pop(i)
            elif lengths[i] < capacity:  # longer rows go on without drafts
                wanted.append((i, np.asarray(tokens[i, : int(lengths[i])], np.int64)))
        # Rows that extend a stream's context: their own stream, or one that moved rows.
        orphans = []
        for i, ctx in wanted:
            tracked = self._claim_extending(unclaimed, i, ctx)
            if tracked is None:
                orphans.append((i, ctx))
            else:
                self._rows[i] = tracked
        self._steps += 1
        for i, ctx in orphans:
            if not unclaimed and self._card_full():
                self.stats.no_stream += 1
                continue
            try:
                self._rows[i] = self._reuse_or_open(unclaimed, i, ctx)
            except CardFullError:
                self.stats.no_stream += 1  # more requests than streams: this one goes without
                self._refused = (self.stats.closed, self._steps)
        for tracked in unclaimed.values():
            self._close(tracked)
        # Each row with a stream: one COMMIT on (accepted count) or a prefill, and its K.
        plans: list[tuple[int, np.ndarray, int | None, int]] = []  # (row, ctx, accepted, K)
        for i, ctx in wanted:
            tracked = self._rows.get(i)
            if tracked is None:
                continue
            limit = k if max_length is None else min(k, max_length - len(ctx))
            limit = max(0, min(limit, tracked.stream.capacity - len(ctx) - 1))  # bonus room
            if self.model_k is not None and not tracked.lookup:
                limit = min(limit, self.model_k)
            plans.append((i, ctx, self._one_round_on(tracked, ctx), limit))
        # A step that held a prompt (a row in prefill, or just out of it) is not what drafting
        # costs: the pass that just ended (vLLM's step since the last call) is not timed.
        only_commits = all(len(new) for new in sampled) and all(p[2] is not None for p in plans)
        timing = self._clock.end_pass(only_commits, now=started)
        if self.adaptive:
            plans = self._plan(plans, k, timing)
        # New rows catch up (prefill, draft), every other row's round goes out in one write,
        # then the drafts come back (speculative/rounds.py).
        steps: list[Commit | CatchUp] = []
        for i, ctx, accepted, limit in plans:
            stream, held = self._rows[i].stream, len(self._rows[i].tokens)
            if accepted is None:
                steps.append(CatchUp(stream, [int(t) for t in ctx[held:]], limit))
            else:
                steps.append(Commit(stream, Verdict(accepted, int(ctx[-1])), limit))
        t0 = self._clock.now()
        results = exchange(self.card, steps)
        card_s = self._clock.now() - t0
        if steps:
            self.round_trips.observe(card_s)
        lost = False
        for (i, ctx, _, _), step, result in zip(plans, steps, results, strict=True):
            if isinstance(result, ExstillError):
                lost |= isinstance(result, DeviceLostError)
                self._drop(i, result)
                continue
            if isinstance(step, Commit):
                self.stats.commits += 1
                self.stats.prefetch_hits += result.prefetch_hit
            else:
                self.stats.prefills += 1
            out[i] = self._record(self._rows[i], ctx, result)
        if lost:  # a card was lost: its other rows' streams too (a pool's other cards go on)
            self._reconnect()
        drafted = sum(len(d) for d in out)
        self._clock.card(card_s, drafted if only_commits else None)
        self._clock.begin_pass(drafted + len(out))
        return out

    def _plan(
        self,
        plans: list[tuple[int, np.ndarray, int | None, int]],
        k: int,
        timing: PassTiming,
    ) -> list[tuple[int, np.ndarray, int | None, int]]:
        """The planner's K for every row (at most its limit), after it has seen the step that
        just ran: each row's accepted count, and the pass's time."""
        planner = self.planner
        if planner is None or planner.max_k < k:
            planner = self.planner = BatchK(max_k=k)
        for i, _, accepted, _ in plans:
            tracked = self._rows[i]
            if accepted is not None and tracked.draft is not None:
                planner.observe_round(tracked.key(), len(tracked.draft), accepted)
        planner.observe_pass(timing)
        ks = planner.choose([self._rows[i].key() for i, *_ in plans], [p[3] for p in plans])
        return [(i, ctx, accepted, kk) for (i, ctx, accepted, _), kk in zip(plans, ks, strict=True)]

    def close(self) -> None:
        """Close every stream (the engine shut down)."""
        rows, self._rows = self._rows, {}
        for tracked in rows.values():
            self._close(tracked)

    # ------------------------------------------------------------------ matching

    @staticmethod
    def _extends(tracked: _Tracked, ctx: np.ndarray) -> bool:
        """Whether the row's tokens continue the stream's, judged by the tokens just before
        the new ones (O(window) a step, whatever the context); a row wrongly matched would
        only draft worse, never change output, since the target verifies every token."""
        n = len(tracked.tokens)
        return n < len(ctx) and continues(tracked.tokens, n, ctx)

    def _claim_extending(
        self, unclaimed: dict[int, _Tracked], row: int, ctx: np.ndarray
    ) -> _Tracked | None:
        own = unclaimed.get(row)
        if own is not None and self._extends(own, ctx):
            return unclaimed.pop(row)
        best = max(
            (r for r, t in unclaimed.items() if self._extends(t, ctx)),
            key=lambda r: len(unclaimed[r].tokens),
            default=None,
        )
        return None if best is None else unclaimed.pop(best)

    def _reuse_or_open(self, unclaimed: dict[int, _Tracked], row: int, ctx: np.ndarray) -> _Tracked:
        if unclaimed:
            best = max(
                unclaimed,
                key=lambda r: (common_prefix(unclaimed[r].tokens, ctx), r == row),
            )
            tracked = unclaimed.pop(best)
            keep = common_prefix(tracked.tokens, ctx)
            if keep == len(ctx):
                keep -= 1  # feed at least one token so the draft follows the whole context
            tracked.stream.rollback(keep)
            tracked.tokens, tracked.draft = tracked.tokens[:keep], None
            self._forget(tracked)
            tracked.request = next(self._requests)
            return tracked
        if self.draft_target is not None:
            stream = self.card.open_stream(
                target=self.draft_target, wire_mode=WireMode.TOKENS, lookup=self.lookup
            )
        else:
            stream = self.card.open_stream(self.engine, wire_mode=WireMode.TOKENS)
        self.stats.opened += 1
        return _Tracked(stream, request=next(self._requests))

    def _close(self, tracked: _Tracked) -> None:
        with contextlib.suppress(ExstillError):  # the card may have dropped it already
            tracked.stream.close()
        self.stats.closed += 1
        self._forget(tracked)

    def _forget(self, tracked: _Tracked) -> None:
        if self.planner is not None:
            self.planner.forget(tracked.key(False))
            self.planner.forget(tracked.key(True))
        tracked.lookup = False

    def _reconnect(self) -> None:
        """Reconnect the card (a pool: the cards lost); rows whose stream went with it go on
        without drafts until they open another."""
        self.stats.reconnects += 1
        with contextlib.suppress(ExstillError):
            self.card.reconnect()
        for row, tracked in list(self._rows.items()):
            if tracked.stream.closed:
                self._forget(tracked)
                del self._rows[row]

    def _drop(self, row: int, exc: ExstillError) -> None:
        log.warning("row %d goes on without drafts: %s", row, exc)
        self.stats.errors += 1
        self._close(self._rows.pop(row))

    # ------------------------------------------------------------------ one row

    def _card_full(self) -> bool:
        """The card refused a stream, none was closed here since, and it was lately."""
        if self._refused is None:
            return False
        closed, step = self._refused
        return closed == self.stats.closed and self._steps - step < RETRY_STEPS

    @staticmethod
    def _one_round_on(tracked: _Tracked, ctx: np.ndarray) -> int | None:
        """How many drafted tokens the row accepted, when ``ctx`` is the stream's context plus
        an accepted prefix of its pending draft and one more token (one COMMIT brings it up to
        date); None when the stream needs a prefill."""
        new = ctx[len(tracked.tokens) :]
        pending = tracked.draft
        if pending is not None and common_prefix(new[:-1], np.asarray(pending)) == len(new) - 1:
            return len(new) - 1
        return None

    @staticmethod
    def _record(tracked: _Tracked, ctx: np.ndarray, draft: Draft) -> list[int]:
        tracked.tokens, tracked.draft, tracked.lookup = ctx, draft.tokens, draft.lookup
        return list(draft.tokens)
