"""Next-draft prefetch: draft ahead on the full-acceptance branch while the host verifies.

After the card replies with a draft d1..dk (and its guess g for the target's bonus token, the
engine's token k+1), it drafts the next round on context + d1..dk + g. A COMMIT of (k accepted,
bonus g, next K within what was prefetched) is then answered from the result at once.

The work runs when the card would otherwise be idle. A serving loop that owns a link (the TCP
server) calls ``run_pending`` right after it has sent its replies, so the work never delays a
reply; with ``background=True`` (the in-process emulator, where the host's own thread runs the
runtime) a worker thread runs it instead. Drafting ahead only reads engine state; the stream's
version counter (a sequence lock, see Stream.version) discards any result computed across a
change.
"""

from __future__ import annotations

import threading
from queue import Empty, SimpleQueue

from .engines.base import propose_grouped
from .streams import PrefetchResult, Stream

Job = tuple[Stream, int, bytes, int]


class Prefetcher:
    def __init__(self, background: bool = False) -> None:
        self._queue: SimpleQueue[Job | None] = SimpleQueue()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="exstill-prefetch", daemon=True)
            self._thread.start()

    def submit(self, stream: Stream, branch_draft: bytes, guess: bytes, k: int) -> None:
        stream.prefetch_scheduled = True
        self._queue.put((stream, stream.version, branch_draft + guess, k))

    def run_pending(self) -> int:
        """Draft ahead for every stream with a pending job; the number of jobs run."""
        latest = self._drain(None)
        self._draft_ahead(list(latest.values()))
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
        while True:
            job = self._queue.get()
            if job is None:
                return
            self._draft_ahead(list(self._drain(job).values()))

    @staticmethod
    def _draft_ahead(jobs: list[Job]) -> None:
        """Draft k+1 tokens after each job's branch, one batch per engine."""
        live = [job for job in jobs if job[0].version == job[1] and not job[0].closed]
        proposals = propose_grouped([(s.engine, s.state, k + 1, b) for s, _, b, k in live])
        for (stream, version, branch, _), proposal in zip(live, proposals, strict=True):
            # an engine that failed: the state changed under it; no draft ahead then
            if stream.version == version and not isinstance(proposal, Exception):
                stream.prefetch = PrefetchResult(
                    version,
                    branch,
                    proposal.tokens,
                    proposal.dists,
                    proposal.lookup,
                )
