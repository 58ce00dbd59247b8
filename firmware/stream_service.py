"""The stream service: every request on a stream (OPEN, CLOSE, PREFILL, ROLLBACK, DRAFT,
COMMIT), drafting, and what the prefetch worker is handed after each draft.

It answers with a reply payload, or, for a COMMIT whose draft ahead missed while the runtime
serves the frames of one read together, with a ``Deferred``: the draft still to make, which
``draft_deferred`` makes for all of them at once (one batched step per drafted position). The
runtime (runtime.py) checks frames and sessions and seals the replies.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from time import perf_counter

import numpy as np

from exstill_sdk.errors import (
    ContextFullError,
    InvalidArgumentError,
    ProtocolError,
    UnknownModelError,
)
from exstill_sdk.protocol import messages as m
from exstill_sdk.protocol.constants import (
    MAX_DIST_ENTRIES,
    MAX_TREE_NODES,
    MAX_TREE_TOP_K,
    ErrorCode,
    ModelKind,
    OpenFlags,
    WireMode,
)
from exstill_sdk.protocol.drafts import Distribution, kept_tree_wire, kept_wire

from .engines import DraftEngine, Sampling
from .engines.base import OutcomeDraft, Proposal, chain_parents, propose_grouped
from .engines.hybrid import HybridEngine
from .prefetch import Prefetcher
from .streams import Session, Stream, StreamTable
from .telemetry import Telemetry


def one_hot(draft: bytes) -> tuple[Distribution, ...]:
    """A deterministic draft's distributions (u32 LE tokens): each token alone, weight 1."""
    return tuple(Distribution((t,), (1,)) for (t,) in struct.iter_unpack("<I", draft))


class Deferred:
    """A COMMIT served but for its draft: ``draft_deferred`` makes the drafts of several such
    COMMITs together."""

    __slots__ = ("k", "stream")

    def __init__(self, stream: Stream, k: int) -> None:
        self.stream, self.k = stream, k


class StreamService:
    def __init__(
        self,
        streams: StreamTable,
        models: dict[str, DraftEngine],
        telemetry: Telemetry,
        prefetcher: Prefetcher | None,
        context: int,
        max_k: int,
    ) -> None:
        self.streams = streams
        self.models = models
        """Engines and targets by name (the image store changes the targets)."""
        self.telemetry = telemetry
        self.prefetcher = prefetcher
        self.context = context
        self.max_k = max_k
        self._hybrids: dict[str, HybridEngine] = {}

    # ------------------------------------------------------------ opening and closing

    def _with_lookup(self, model: DraftEngine) -> DraftEngine:
        """The target's model with prompt lookup in front (OpenFlags.LOOKUP), one per model so
        that its streams draft together."""
        if model.kind != ModelKind.TARGET:
            raise InvalidArgumentError(
                f"{model.name!r} is an engine: LOOKUP is for target streams (open the lookup "
                "engine itself for lookup alone)"
            )
        hybrid = self._hybrids.get(model.name)
        if hybrid is None or hybrid.model is not model:
            hybrid = self._hybrids[model.name] = HybridEngine(model)
        return hybrid

    def open(self, session: Session, handle: int, payload: bytes) -> bytes:
        req = m.decode_open_request(payload)
        model = self.models.get(req.name)
        if model is None or model.kind != req.kind:
            kind = ModelKind(req.kind).name.lower() if req.kind in (0, 1) else "model"
            raise UnknownModelError(
                f"this card has no {kind} {req.name!r}; it has: "
                + ", ".join(sorted(self.models) or ["nothing"])
            )
        if req.wire_mode not in (WireMode.TOKENS, WireMode.DIST):
            raise InvalidArgumentError(f"unknown wire mode {req.wire_mode}")
        max_k = req.max_k or self.max_k
        if max_k > self.max_k:
            raise InvalidArgumentError(
                f"max K {max_k} exceeds this card's {self.max_k}", ErrorCode.K_OUT_OF_RANGE
            )
        if req.flags & ~(OpenFlags.LONG_CONTEXT | OpenFlags.LOOKUP):
            raise InvalidArgumentError(f"unknown OPEN flags 0x{req.flags:02x}")
        long_context = bool(req.flags & OpenFlags.LONG_CONTEXT)
        if req.flags & OpenFlags.LOOKUP:
            model = self._with_lookup(model)
        dist = req.wire_mode == WireMode.DIST
        sampling = Sampling(  # checks the values as the host's SamplingParams does
            req.temperature, req.top_k, req.top_p, req.seed, MAX_DIST_ENTRIES if dist else 0
        )
        slot = self.streams.free_slot()
        stream = Stream(
            slot=slot,
            handle=self.streams.new_handle(slot),
            session=session,
            engine=model,
            state=model.open_state(self.context, sampling, long_context),
            sampling=sampling,
            capacity=1 << 62 if long_context else self.context,
            max_k=max_k,
            dist=dist,
        )
        if self.prefetcher is not None and self.prefetcher.outcomes:
            stream.state.keep_logits = True
        self.streams.add(stream)
        self.telemetry.streams_opened += 1
        return m.encode_open_reply(m.OpenReply(stream.handle, self.context, max_k))

    def close(self, session: Session, handle: int, payload: bytes) -> bytes:
        self.streams.remove(self.streams.get(session, handle))
        return b""

    # ------------------------------------------------------------ the context

    def prefill(self, session: Session, handle: int, payload: bytes) -> bytes:
        stream = self.streams.get(session, handle)
        if len(payload) & 3:
            raise ProtocolError(f"prefill of {len(payload)} bytes is not whole u32 tokens")
        self._check_room(stream, len(payload) >> 2)
        vocab = stream.engine.vocab_size
        if vocab and payload and int(np.frombuffer(payload, "<u4").max()) >= vocab:
            raise InvalidArgumentError(
                f"a token id is beyond {stream.engine.name!r}'s vocabulary of {vocab}: "
                "the prompt was tokenized for another model"
            )
        stream.begin_change()
        stream.pending, stream.pending_parents = b"", None
        stream.state.extend(payload)
        stream.end_change()
        if self.prefetcher is not None:  # take the tokens in while idle: drafting next is quick
            self.prefetcher.submit(stream, b"", b"", 0)
        return m.U32.pack(stream.length)

    def rollback(self, session: Session, handle: int, payload: bytes) -> bytes:
        stream = self.streams.get(session, handle)
        length = m.decode_u32(payload)
        if length > stream.length:
            raise InvalidArgumentError(
                f"cannot roll back to {length}: the stream holds {stream.length} tokens"
            )
        stream.begin_change()
        stream.pending, stream.pending_parents = b"", None
        try:
            stream.state.truncate(length)  # may refuse (long context: evicted tokens)
        finally:
            stream.end_change()
        return m.U32.pack(length)

    # ------------------------------------------------------------ rounds

    def draft(self, session: Session, handle: int, payload: bytes) -> bytes:
        stream = self.streams.get(session, handle)
        k = m.decode_u8(payload)
        self._check_k(stream, k)
        stream.begin_change()  # a new draft replaces the pending one and voids its prefetch
        stream.end_change()
        return self._draft_reply(stream, k)

    def commit(
        self, session: Session, handle: int, payload: bytes, defer: bool = False
    ) -> bytes | Deferred:
        """A verification round: the verdict on the pending draft, committed, and the next
        draft (from the draft made ahead when it matches; with ``defer``, a miss is a
        ``Deferred`` for ``draft_deferred``)."""
        # The per-round path: checks are inlined, and nothing changes before they all pass.
        stream = self.streams.by_handle.get(handle)
        if stream is None or stream.session is not session:
            stream = self.streams.get(session, handle)  # raises the typed error
        if len(payload) != 6:
            raise ProtocolError(f"COMMIT payload must be 6 bytes, got {len(payload)}")
        accepted, next_k, bonus = m.COMMIT_REQUEST.unpack(payload)
        vocab = stream.engine.vocab_size
        if vocab and bonus >= vocab:
            raise InvalidArgumentError(
                f"token {bonus} is beyond {stream.engine.name!r}'s vocabulary of {vocab}"
            )
        pending = stream.pending
        if stream.pending_parents is not None:
            raise InvalidArgumentError(
                "the last draft was a token tree: commit it with COMMIT_TREE, naming its path"
            )
        if accepted << 2 > len(pending):
            raise InvalidArgumentError(
                f"accepted {accepted} tokens but the last draft had {len(pending) >> 2}"
            )
        if next_k > stream.max_k:
            self._check_k(stream, next_k)
        state = stream.state
        if state.length + accepted + 1 > stream.capacity:
            self._check_room(stream, accepted + 1)
        t = self.telemetry
        t.rounds += 1
        t.accepted_tokens += accepted
        if stream.replied_at:  # how long the host took: the time there is to draft ahead
            seen = perf_counter() - stream.replied_at
            # the first as seen; then down at once, up slowly (a round the card answered late
            # looks longer than it was)
            stream.window = (
                min(seen, stream.window + 0.25 * (seen - stream.window)) if stream.window else seen
            )
        committed = kept_wire(pending, accepted, payload[2:6])
        pf = stream.prefetch
        hit = (
            pf
            if pf is not None
            and pf.version == stream.version
            and pf.branch == committed
            and len(pf.tokens) >= next_k << 2
            else None
        )
        outcome = None
        if hit is None and stream.outcomes_scheduled and next_k:
            outcome = self._outcome_drafted(stream, committed)
        whole = outcome is not None and len(outcome.proposal.tokens) >= next_k << 2
        if stream.prefetch_scheduled:
            if hit is not None or whole:
                t.prefetch_hits += 1
                t.prefetch_hits_by_accepted[accepted] += 1
                t.prefetch_outcome_hits += whole
            elif pf is None or pf.version != stream.version:
                t.prefetch_late += 1
            else:
                t.prefetch_misses += 1
                t.prefetch_wasted_tokens += len(pf.tokens) >> 2
        stream.begin_change()
        state.extend(committed)
        if outcome is not None:
            state.adopt_outcome(outcome)
        stream.end_change()
        if hit is not None:
            return self._serve(stream, next_k, hit.tokens, hit.dists, True, hit.lookup, hit.logits)
        if outcome is not None:
            made = outcome.proposal
            if whole:
                return self._serve(
                    stream, next_k, made.tokens, made.dists, True, False, made.logits
                )
            t.prefetch_outcome_partial += 1
            return self._finish(stream, next_k, made)
        if defer and next_k:
            return Deferred(stream, next_k)
        return self._draft_reply(stream, next_k)

    def _outcome_drafted(self, stream: Stream, committed: bytes) -> OutcomeDraft | None:
        """The draft made (or begun) ahead for the outcome being committed, if any; counts the
        outcome work thrown away or not done in time."""
        t = self.telemetry
        drafts = stream.outcomes
        if drafts is None or drafts.version != stream.version:
            t.prefetch_outcomes_late += 1
            return None
        t.prefetch_outcomes_late += not drafts.complete
        made = drafts.drafts.get(committed)
        t.prefetch_wasted_tokens += sum(
            len(d.proposal.tokens) >> 2 for d in drafts.drafts.values() if d is not made
        )
        return made

    def _finish(self, stream: Stream, k: int, made: Proposal) -> bytes:
        """Reply with a draft begun ahead for this outcome and finished now: the tokens made
        ahead, then the rest (and the guess) drafted after them."""
        count = len(made.tokens) >> 2
        rest = stream.state.finish_draft(k + 1 - count, made.tokens)
        dists = None if made.dists is None or rest.dists is None else made.dists + rest.dists
        logits = (
            None
            if made.logits is None or rest.logits is None
            else np.concatenate([made.logits, rest.logits])
        )
        return self._serve(stream, k, made.tokens + rest.tokens, dists, False, False, logits)

    # ------------------------------------------------------------ token trees

    def draft_tree(self, session: Session, handle: int, payload: bytes) -> bytes:
        stream = self.streams.get(session, handle)
        req = m.decode_tree_request(payload)
        self._check_tree(stream, req)
        stream.begin_change()
        stream.end_change()
        return self._tree_reply(stream, req)

    def commit_tree(self, session: Session, handle: int, payload: bytes) -> bytes:
        """A verification round on a tree (or chain) draft: the accepted path and the target's
        token committed, then the next tree. Nothing changes unless every check passes."""
        stream = self.streams.get(session, handle)
        req = m.decode_commit_tree_request(payload)
        vocab = stream.engine.vocab_size
        if vocab and req.bonus >= vocab:
            raise InvalidArgumentError(
                f"token {req.bonus} is beyond {stream.engine.name!r}'s vocabulary of {vocab}"
            )
        count = len(stream.pending) >> 2
        path = bytes(req.path)
        # a pending chain is the tree whose path is its accepted prefix
        if not m.check_path(stream.pending_parents or chain_parents(count), path):
            raise InvalidArgumentError(
                f"path {list(req.path)} is not a path of the last draft ({count} tokens) from "
                "the context"
            )
        if req.next.nodes:
            self._check_tree(stream, req.next)
        self._check_room(stream, len(path) + 1)
        t = self.telemetry
        t.rounds += 1
        t.accepted_tokens += len(path)
        committed = kept_tree_wire(stream.pending, path, payload[:4])
        stream.begin_change()
        stream.state.extend(committed)
        stream.end_change()
        return self._tree_reply(stream, req.next)

    def _check_tree(self, stream: Stream, shape: m.TreeRequest) -> None:
        if not 1 <= shape.top_k <= MAX_TREE_TOP_K or shape.nodes > MAX_TREE_NODES:
            raise InvalidArgumentError(
                f"a tree has 0..{MAX_TREE_NODES} nodes and top-k 1..{MAX_TREE_TOP_K}, not "
                f"{shape.nodes} and {shape.top_k}",
                ErrorCode.K_OUT_OF_RANGE,
            )
        if not stream.sampling.greedy and not stream.dist and shape.top_k > 1:
            raise InvalidArgumentError(
                "a sampled stream's tree needs its distributions on the wire: open the stream "
                "in DIST wire mode, or ask for top-k 1"
            )

    def _tree_reply(self, stream: Stream, shape: m.TreeRequest) -> bytes:
        proposal = stream.state.propose_tree(shape) if shape.nodes else None
        if proposal is None or not proposal.tokens:
            stream.pending, stream.pending_parents = b"", None
            return m.tree_reply_payload(False, b"", b"", False)
        chain = proposal.parents == chain_parents(len(proposal.parents))
        stream.pending = proposal.tokens
        stream.pending_parents = None if chain else proposal.parents  # as the host reads it
        t = self.telemetry
        t.drafts += 1
        t.draft_tokens += len(proposal.parents)
        dists = None
        if stream.dist and not stream.sampling.greedy:  # a deterministic draft is one-hot
            dists = proposal.dists or one_hot(proposal.tokens)
        return m.tree_reply_payload(
            False, proposal.tokens, proposal.parents, proposal.lookup, dists
        )

    def draft_deferred(self, jobs: Sequence[Deferred]) -> list[bytes | Exception]:
        """The deferred drafts, one ``propose_many`` per engine: each job's reply payload, or
        the error its engine raised."""
        ahead = self.prefetcher is not None  # one more token: the bonus guess
        proposals = propose_grouped(
            [(d.stream.engine, d.stream.state, d.k + ahead, b"") for d in jobs]
        )
        out: list[bytes | Exception] = []
        for d, proposal in zip(jobs, proposals, strict=True):
            if isinstance(proposal, Exception):
                out.append(proposal)
            else:
                out.append(
                    self._serve(
                        d.stream,
                        d.k,
                        proposal.tokens,
                        proposal.dists,
                        lookup=proposal.lookup,
                        logits=proposal.logits,
                    )
                )
        return out

    # ------------------------------------------------------------ drafting

    def _check_k(self, stream: Stream, k: int) -> None:
        if k > stream.max_k:
            raise InvalidArgumentError(
                f"K {k} exceeds the stream's max K {stream.max_k}", ErrorCode.K_OUT_OF_RANGE
            )

    def _check_room(self, stream: Stream, extra: int) -> None:
        if stream.length + extra > stream.capacity:
            raise ContextFullError(
                f"{extra} more tokens would take the stream past its {stream.capacity}-token "
                f"slot (it holds {stream.length}); roll back or open a new stream"
            )

    def _draft_reply(self, stream: Stream, k: int) -> bytes:
        ask = k + 1 if self.prefetcher is not None and k else k
        proposal: Proposal | None = stream.state.propose(ask) if k else None
        if proposal is None:
            return self._serve(stream, 0, b"", None)
        return self._serve(
            stream, k, proposal.tokens, proposal.dists, lookup=proposal.lookup,
            logits=proposal.logits,
        )  # fmt: skip

    def _serve(
        self,
        stream: Stream,
        k: int,
        tokens: bytes,
        dists: tuple[Distribution, ...] | None,
        prefetch_hit: bool = False,
        lookup: bool = False,
        logits: np.ndarray | None = None,
    ) -> bytes:
        """Reply with the first k of ``tokens``; a (k+1)-th token is the bonus guess that the
        next prefetch drafts after (and ``logits``, when kept, what the draft and guess were
        chosen from: what other outcomes are ranked by)."""
        draft = tokens[: k << 2]
        guess = tokens[k << 2 : (k << 2) + 4]
        count = len(draft) >> 2
        stream.pending, stream.pending_parents = draft, None
        t = self.telemetry
        if count:
            t.drafts += 1
            t.draft_tokens += count
        stream.logits = None
        if guess and count == k and self.prefetcher is not None:
            if logits is not None and len(logits) > k:
                stream.logits = logits[: k + 1]
            stream.replied_at = perf_counter()
            self.prefetcher.submit(stream, draft, guess, k)
        lookup = lookup and count > 0
        if not stream.dist:
            return m.draft_reply_payload(prefetch_hit, draft, None, lookup)
        if dists is None:  # deterministic draft: each position is one-hot
            return m.one_hot_reply_payload(prefetch_hit, draft, lookup)
        return m.draft_reply_payload(prefetch_hit, draft, dists[:count], lookup)
