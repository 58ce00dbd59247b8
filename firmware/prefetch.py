"""Drafting ahead while the host verifies: the full-acceptance branch first, then other
outcomes in the time left.

After the card replies with a draft d1..dk (and its guess g for the target's bonus token, the
engine's token k+1), it drafts the next round on context + d1..dk + g. A COMMIT of (k accepted,
bonus g, next K within what was prefetched) is then answered from the result at once. With
``outcomes`` on, the card then drafts ahead for the next likeliest outcomes as well (other
accepted lengths, other bonus tokens: outcomes.py), as many as fit in the time the host takes
to verify, and a COMMIT of any of them is answered at once too.

The work runs when the card would otherwise be idle. A serving loop that owns a link (the TCP
server) calls ``run_pending`` right after it has sent its replies, so the work never delays a
reply, and gives it a ``stop`` that says when the host's next request has arrived; with
``background=True`` (the in-process emulator, where the host's own thread runs the runtime) a
worker thread runs it instead, stopping when new work is queued. Drafting ahead only reads
engine state; the stream's version counter (a sequence lock, see Stream.version) discards any
result computed across a change.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable
from queue import Empty, SimpleQueue

from .engines.base import propose_grouped
from .outcomes import (
    WINDOW_SHARE,
    Outcome,
    OutcomeSet,
    PassCost,
    plan_outcomes,
    rank_outcomes,
    width_limit,
)
from .streams import PrefetchResult, Stream
from .telemetry import Telemetry

Job = tuple[Stream, int, bytes, int]


def _never() -> bool:
    return False


class Prefetcher:
    def __init__(
        self, background: bool = False, outcomes: bool = True, telemetry: Telemetry | None = None
    ) -> None:
        """``outcomes``: draft ahead for other outcomes too, not the full-acceptance one
        only; ``telemetry``: where the steps of drafting ahead are counted and timed."""
        self.outcomes = outcomes
        self.telemetry = telemetry
        self.cost = PassCost()
        """What a pass of the outcome tree costs, as timed (outcomes.py)."""
        self._queue: SimpleQueue[Job | None] = SimpleQueue()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="exstill-prefetch", daemon=True)
            self._thread.start()

    def submit(self, stream: Stream, branch_draft: bytes, guess: bytes, k: int) -> None:
        stream.prefetch_scheduled = True
        self._queue.put((stream, stream.version, branch_draft + guess, k))

    def run_pending(self, stop: Callable[[], bool] | None = None) -> int:
        """Draft ahead for every stream with a pending job; the number of jobs run. ``stop``:
        whether to give up the outcome work (the host's next request is waiting)."""
        latest = self._drain(None)
        self._draft_ahead(list(latest.values()), stop or _never)
        return len(latest)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
            self._thread = None

    def _drain(self, first: Job | None) -> dict[int, Job]:
        """Take every queued job, keeping only the newest per stream (older ones are for
        rounds already gone)."""
        latest: dict[int, Job] = {}
        job = first
        while True:
            if job is not None:
                latest[id(job[0])] = job
            try:
                job = self._queue.get_nowait()
            except Empty:
                return latest
            if job is None:  # close() while draining: put the stop marker back
                self._queue.put(None)
                return latest

    def _run(self) -> None:
        queue = self._queue
        while True:
            job = queue.get()
            if job is None:
                return
            self._draft_ahead(list(self._drain(job).values()), lambda: not queue.empty())

    def _draft_ahead(self, jobs: list[Job], stop: Callable[[], bool]) -> None:
        """Draft k+1 tokens after each job's branch, one batch per engine; then, in the time
        left, after other outcomes."""
        live = [job for job in jobs if job[0].version == job[1] and not job[0].closed]
        started = time.perf_counter()
        proposals = propose_grouped([(s.engine, s.state, k + 1, b) for s, _, b, k in live])
        steps = max((k + 1 for *_, k in live), default=0)
        elapsed = time.perf_counter() - started
        if steps > 1:
            self.cost.chain_step(elapsed / steps)
        if steps and self.telemetry is not None:
            t = self.telemetry
            t.ahead_steps += steps
            t.ahead_step_us += int(elapsed * 1e6)
            t.ahead_step_streams += steps * len(live)
        for (stream, version, branch, _), proposal in zip(live, proposals, strict=True):
            # an engine that failed: the state changed under it; no draft ahead then
            if stream.version == version and not isinstance(proposal, Exception):
                stream.prefetch = PrefetchResult(
                    version,
                    branch,
                    proposal.tokens,
                    proposal.dists,
                    proposal.lookup,
                    proposal.logits,
                )
        if self.outcomes:
            self._draft_outcomes([job for job in live if job[3]], stop)

    def _draft_outcomes(self, jobs: list[Job], stop: Callable[[], bool]) -> None:
        """Draft ahead for the likeliest other outcomes of each job's draft that fit before
        the host's COMMIT is due (outcomes.py)."""
        fit = self.cost.fit()
        if fit is None:
            return
        now = time.perf_counter()
        ranked: list[tuple[list[Outcome], int, int]] = []
        chosen: list[Job] = []
        due = float("inf")
        for job in jobs:
            stream, version, branch, k = job
            logits = stream.logits
            if logits is None or not stream.window or stream.version != version:
                continue
            count = k + 1
            stream_due = stream.replied_at + WINDOW_SHARE * stream.window
            if now + count * (fit[0] + fit[1]) > stream_due:
                continue  # not one outcome fits before its COMMIT: ranking them would delay it
            limit = width_limit(count, stream.engine.vocab_size, stream.state.keep_logits)
            drafted = struct.unpack(f"<{count}I", branch)
            outcomes = rank_outcomes(drafted, logits, limit, stream.engine.rank_temperature)
            if outcomes:
                ranked.append((outcomes, count, limit))
                chosen.append(job)
                due = min(due, stream_due)
        for planned in plan_outcomes(ranked, due - now, fit) if ranked else ():
            stream, version, branch, k = chosen[planned.job]
            if stop() or stream.version != version:
                continue
            assert fit is not None  # a plan is made only with a cost
            stream.outcomes_scheduled = True
            passes = _Passes(stop, stream, version, due - fit[0] - fit[1] * len(planned.roots))
            drafts = stream.state.draft_outcomes(branch[: 4 * k], planned.roots, k + 1, passes)
            if passes.started:  # the passes done, timed, whether or not all were
                each = passes.seconds_each()
                self.cost.add(len(planned.roots), each)
                if self.telemetry is not None:
                    t = self.telemetry
                    t.outcome_passes += passes.started
                    t.outcome_pass_us += int(each * passes.started * 1e6)
                    t.outcome_pass_width += passes.started * len(planned.roots)
            if drafts is not None and stream.version == version:  # done, or begun
                stream.outcomes = OutcomeSet(
                    version, {d.committed: d for d in drafts}, passes.started == k + 1
                )


class _Passes:
    """The ``stop`` an engine calls before each pass of an outcome draft: it stops when the
    stream changed, when the serving loop says so, or when a pass begun now would end after
    the COMMIT is due (``last_start``); and it times the passes."""

    __slots__ = ("first", "last_start", "started", "stop", "stream", "version")

    def __init__(
        self, stop: Callable[[], bool], stream: Stream, version: int, last_start: float
    ) -> None:
        self.stop, self.stream, self.version = stop, stream, version
        self.last_start = last_start
        self.started = 0
        self.first = time.perf_counter()

    def __call__(self) -> bool:
        if (
            self.stream.version != self.version
            or time.perf_counter() > self.last_start
            or self.stop()
        ):
            return True
        self.started += 1
        return False

    def seconds_each(self) -> float:
        """Seconds per pass so far (called when the engine has returned)."""
        return (time.perf_counter() - self.first) / self.started
