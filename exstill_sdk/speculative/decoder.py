"""SpeculativeDecoder: the card drafts, the target verifies, the user gets the target's tokens.

One round per sequence: the target scores the card's draft (one call, K + 1 positions), the
acceptance rule picks the accepted prefix and the target's next token, and one COMMIT tells the
card (accepted count, that token, next K) and brings back the next draft, which the card may
already have drafted ahead while the target was verifying.

Several sequences share each round: the target verifies all of them in one ``verify_batch``
call (one pass over its weights, for a target that batches), their COMMITs go to the card
together and the replies are read after, and with adaptive K their draft lengths are chosen
together (exstill_sdk.speculative.batch_k: what a pass costs depends on the tokens in it, so
the best K depends on how many sequences share it). A sequence the card has no free stream for
runs with the target alone (K = 0) and asks again only when a stream has been freed.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from exstill_sdk.card import Card, Draft, DraftStream
from exstill_sdk.errors import (
    CardFullError,
    ContextFullError,
    DeviceLostError,
    InvalidArgumentError,
    LinkTimeoutError,
    TargetOutputError,
    TokenizerMismatchError,
    UnknownModelError,
)
from exstill_sdk.protocol.constants import WireMode
from exstill_sdk.speculative.acceptance import (
    verify_greedy,
    verify_tokens_only,
    verify_with_distributions,
)
from exstill_sdk.speculative.adapter import TargetAdapter
from exstill_sdk.speculative.adaptive import AdaptiveK, FixedK, KPolicy
from exstill_sdk.speculative.batch_k import BatchK
from exstill_sdk.speculative.metrics import SpecMetrics
from exstill_sdk.speculative.sampling import SamplingParams, target_probs

FinishReason = Literal["stop", "length"]
RECONNECT_ATTEMPTS = 3
RECONNECT_PAUSE = 0.2
SYNC_EVERY = 128
"""While K = 0, the tokens the card has not seen go to it this many at a time, without waiting:
the card takes them in on its own time, so that drafting again costs one short round."""
_NO_DRAFT = Draft(())


class _StreamLost(Exception):
    """A COMMIT found the card gone; the round's tokens (already verified) still count."""

    def __init__(self, emitted: list[int]) -> None:
        self.emitted = emitted


@dataclass
class GenerationResult:
    tokens: list[int]
    """Generated tokens (the prompt excluded), every one the target's own."""
    finish_reason: FinishReason
    metrics: SpecMetrics


@dataclass
class _Sequence:
    index: int
    prompt: list[int]
    max_new_tokens: int
    stops: frozenset[int]
    policy: KPolicy
    rng: np.random.Generator
    metrics: SpecMetrics
    tokens: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    stream: DraftStream | None = None
    draft: Draft | None = None
    card_behind: bool = False
    """True after rounds without a card round (K = 0): the card has not been told the tokens
    since its last draft; they go to it in the background (``sync_rid``) and the rest before
    its next draft."""
    sync_rid: int | None = None
    """A PREFILL sent without waiting, whose reply is still to be read."""
    commit_plan: tuple[int, int, int] | None = None
    """A COMMIT (accepted, bonus, next K) to send with the batch's others."""
    commit_rid: tuple[int, int] | None = None
    """A COMMIT sent without waiting (a batch's rounds travel together): its request id and
    accepted count, the reply still to read."""
    finished: bool = False
    previous_start: float = 0.0
    last_card_wait: float = 0.0
    asked_k: int = 0
    finish: FinishReason | None = None
    round_start: float = 0.0
    started: float = 0.0


class SpeculativeDecoder:
    """Speculative decoding with a card and a target.

    ``draft`` names the card's target image to draft with (its tokenizer must be the
    target's); without it, the card's built-in ``engine`` (prompt lookup by default) drafts.
    ``k`` is a fixed draft length or ``"adaptive"`` (see exstill_sdk.speculative.adaptive).
    """

    def __init__(
        self,
        card: Card,
        target: TargetAdapter,
        *,
        draft: str | None = None,
        engine: str | None = None,
        sampling: SamplingParams | None = None,
        k: int | Literal["adaptive"] = "adaptive",
        max_k: int = 8,
        wire_mode: WireMode = WireMode.DIST,
        long_context: bool = False,
    ) -> None:
        self.card = card
        self.target = target
        self.sampling = sampling or SamplingParams()
        if not isinstance(max_k, int) or max_k < 0:
            raise InvalidArgumentError(f"max_k must be a whole number 0 or more, not {max_k!r}")
        self.max_k = min(max_k, card.info().max_k)
        if k != "adaptive" and not (isinstance(k, int) and 0 <= k <= self.max_k):
            raise InvalidArgumentError(f"k must be 0..{self.max_k} or 'adaptive', not {k!r}")
        self.k = k
        self.wire_mode = wire_mode
        self.long_context = long_context
        self.draft_target = draft
        self.engine = engine
        if draft is not None:
            self._check_target(draft)
        self.metrics = SpecMetrics(max_k=self.max_k)
        self._adaptive = AdaptiveK(self.max_k) if k == "adaptive" else None
        """One adaptive policy for every sequence of this decoder: what a round costs is the
        target's and the card's, not a sequence's, and it is learnt once."""
        self._batch_k = BatchK(self.max_k) if k == "adaptive" else None
        """K for rounds of several sequences (one pass over the target for all of them)."""
        self._last_pass: tuple[int, float, int | None, float] | None = None
        """The last batch pass (tokens, seconds, tokens then drafted, when it ended), to be
        observed with the time until the next pass; None when it fed a prompt."""
        self._streams_freed = 0
        self._card_full_at = -1
        """``_streams_freed`` when the card last refused a stream: sequences without one ask
        again only after this decoder has freed one."""
        self.reconnects = 0
        """Times the decoder re-established the card link and re-opened its streams."""
        self._next_index = 0

    def _check_target(self, name: str) -> None:
        info = {t.name: t for t in self.card.info().targets}.get(name)
        if info is None:
            raise UnknownModelError(
                f"the card has no target {name!r}; it has: "
                + (", ".join(sorted(t.name for t in self.card.info().targets)) or "none")
            )
        if info.vocab_size != self.target.vocab_size:
            raise TokenizerMismatchError(
                f"the card's {name!r} drafts over {info.vocab_size} tokens, the target scores "
                f"{self.target.vocab_size}: the image was made for another model"
            )
        fingerprint = self.target.tokenizer
        if fingerprint is not None and fingerprint.sha256 != info.tokenizer_sha256:
            raise TokenizerMismatchError(
                f"the card's {name!r} was packed for tokenizer {info.tokenizer_sha256.hex()[:16]}"
                f"..., the target's is {fingerprint.sha256.hex()[:16]}...; pack the draft with "
                "the target's tokenizer.json"
            )

    # ------------------------------------------------------------------ public API

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        stop_token_ids: Iterable[int] | None = None,
    ) -> GenerationResult:
        return self.generate_batch([prompt_ids], max_new_tokens, stop_token_ids)[0]

    def stream(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        stop_token_ids: Iterable[int] | None = None,
    ) -> Iterator[int]:
        """Tokens as the target accepts them."""
        for _, emitted in self._run([prompt_ids], max_new_tokens, stop_token_ids):
            yield from emitted

    def stream_batch(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        stop_token_ids: Iterable[int] | None = None,
    ) -> Iterator[tuple[int, list[int]]]:
        """Several sequences' tokens as the target accepts them: (prompt index, tokens)."""
        first = self._next_index
        for s, emitted in self._run(prompts, max_new_tokens, stop_token_ids):
            yield s.index - first, emitted

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        stop_token_ids: Iterable[int] | None = None,
    ) -> list[GenerationResult]:
        """Several sequences; more than the card's free streams wait for one to finish."""
        sequences: dict[int, _Sequence] = {}
        for _ in self._run(prompts, max_new_tokens, stop_token_ids, sequences):
            pass
        ordered = sorted(sequences.values(), key=lambda s: s.index)
        return [GenerationResult(s.generated, s.finish or "length", s.metrics) for s in ordered]

    # ------------------------------------------------------------------ the loop

    def _new_sequence(
        self, prompt: Sequence[int], max_new_tokens: int, stops: frozenset[int]
    ) -> _Sequence:
        index = self._next_index
        self._next_index += 1
        seed = self.sampling.seed
        rng = np.random.default_rng(None if seed is None else [seed, index])
        policy = self._adaptive if self._adaptive is not None else FixedK(int(self.k))
        tokens = [int(t) for t in prompt]
        return _Sequence(
            index,
            tokens,
            max_new_tokens,
            stops,
            policy,
            rng,
            SpecMetrics(max_k=self.max_k),
            tokens=list(tokens),
        )

    def _run(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        stop_token_ids: Iterable[int] | None,
        sink: dict[int, _Sequence] | None = None,
    ) -> Iterator[tuple[_Sequence, list[int]]]:
        if max_new_tokens < 1:
            raise InvalidArgumentError("max_new_tokens must be at least 1")
        stops = frozenset(self.target.eos_token_ids if stop_token_ids is None else stop_token_ids)
        for p in prompts:
            if not p:
                raise InvalidArgumentError("a prompt needs at least one token")
            capacity = self.card.info().context
            if not self.long_context and len(p) + max_new_tokens > capacity:
                raise ContextFullError(
                    f"prompt of {len(p)} tokens + {max_new_tokens} new ones exceed the card's "
                    f"{capacity}-token slot; shorten it or use long_context=True"
                )
        pending = deque(self._new_sequence(p, max_new_tokens, stops) for p in prompts)
        if sink is not None:
            sink.update({s.index: s for s in pending})
        active: list[_Sequence] = []
        started = time.perf_counter()
        self._last_pass = None
        try:
            while pending or active:
                while pending:
                    try:
                        batch = bool(active) or len(pending) > 1
                        self._start(pending[0], batch and len(active) < self.target.max_batch)
                    except CardFullError:
                        if not active:
                            raise
                        break  # wait for a running sequence to free its stream
                    except DeviceLostError:
                        self._recover(active)
                        continue
                    active.append(pending.popleft())
                if len(active) == 1 and not pending and active[0].draft is _NO_DRAFT:
                    burst = active[0].policy.plain_rounds()
                    if burst > 1:
                        self._last_pass = None
                        try:
                            yield from self._plain_burst(active[0], burst)
                        except _StreamLost:
                            self._recover(active)
                        active = [s for s in active if s.finish is None]
                        continue
                items = [(s.index, s.tokens, s.draft.tokens) for s in active]  # type: ignore[union-attr]
                t0 = time.perf_counter()
                all_logits = self.target.verify_batch(items)
                verify_s = time.perf_counter() - t0
                lost = False
                if len(active) > 1:
                    lost = yield from self._batch_round(active, all_logits, t0, verify_s)
                else:
                    self._last_pass = None
                    s = active[0]
                    try:
                        emitted = self._round(s, all_logits[0], verify_s)
                    except _StreamLost as exc:
                        emitted, lost = exc.emitted, True
                    yield s, emitted
                active = [s for s in active if s.finish is None]
                if lost:
                    self._recover(active)
        finally:
            for s in active + list(pending):
                self._finish(s)
            elapsed = time.perf_counter() - started
            self.metrics.total_s += elapsed

    def _batch_round(
        self, active: list[_Sequence], all_logits: list[np.ndarray], t0: float, verify_s: float
    ) -> Generator[tuple[_Sequence, list[int]], None, bool]:
        """One round of several sequences after their one verification pass: acceptance for
        each, the next K for all together, their COMMITs sent together and the replies read
        after. Returns whether the card was lost."""
        planner = self._batch_k
        if planner is not None and self._last_pass is not None:
            tokens, seconds, drafted, end = self._last_pass
            planner.observe_pass(tokens, seconds, drafted, t0 - end)
        steady = all(s.metrics.rounds for s in active)  # no prompt in this pass
        pass_tokens = 0
        for s in active:
            pass_tokens += len(s.draft.tokens) + 1  # type: ignore[union-attr]
        each = verify_s / len(active)
        going: list[tuple[_Sequence, int, int]] = []
        for s, logits in zip(active, all_logits, strict=True):
            draft = s.draft.tokens  # type: ignore[union-attr]
            n, token = self._accept(s, draft, logits)
            emitted = self._emit(s, draft, n, token, each)
            if planner is not None:
                planner.observe_round(s.index, len(draft), n)
            yield s, emitted
            if s.finish is None:
                going.append((s, n, token))
            else:
                self._finish(s)
        seqs = [s for s, _, _ in going]
        limits = [self._limit(s) for s in seqs]
        if planner is not None:
            ks = planner.choose([s.index for s in seqs], limits)
        else:
            ks = [s.policy.choose(limit) for s, limit in zip(seqs, limits, strict=True)]
        lost = False
        only_commits = True  # no stream brought up to date: the round costs what drafting does
        for (s, n, token), k in zip(going, ks, strict=True):
            s.metrics.k_chosen[k] += 1
            try:
                s.draft = self._next_draft(s, n, token, k, defer=True)
            except DeviceLostError:
                s.draft, lost = None, True
            only_commits &= s.commit_plan is not None or not k
        try:
            with self.card.sent_together():  # one write: the card drafts the misses as one
                for s in seqs:
                    if s.commit_plan is not None and s.stream is not None:
                        (accepted, token, k), s.commit_plan = s.commit_plan, None
                        s.commit_rid = (s.stream.send_commit(accepted, token, k), accepted)
        except DeviceLostError:
            lost = True
            for s in seqs:
                s.commit_plan = s.commit_rid = None
                s.draft = None
        waited = time.perf_counter()
        for s in seqs:
            if s.commit_rid is not None and s.stream is not None:
                (rid, accepted), s.commit_rid = s.commit_rid, None
                try:
                    s.draft = s.stream.receive_commit(rid, accepted)
                except DeviceLostError:
                    s.draft, lost = None, True
            if s.draft is not None:
                s.metrics.prefetch_hits += s.draft.prefetch_hit
        end = time.perf_counter()
        for s in seqs:
            s.metrics.card_wait_s += (end - waited) / len(seqs)
            s.previous_start = s.round_start = end
        drafted = sum(ks) if only_commits else None
        self._last_pass = (pass_tokens, verify_s, drafted, t0 + verify_s) if steady else None
        return lost

    def _limit(self, s: _Sequence) -> int:
        """The largest useful K: the card's, the budget's and the slot's."""
        remaining = s.max_new_tokens - len(s.generated) - 1
        limit = min(self.max_k, remaining)
        if s.stream is not None and not self.long_context:
            limit = min(limit, s.stream.capacity - s.stream.length - 1)
        elif s.stream is None and self._card_full_at == self._streams_freed:
            return 0  # the card refused a stream and none has been freed since
        return max(0, limit)

    def _open(self, s: _Sequence) -> DraftStream:
        """A card stream holding the sequence's context so far."""
        sp = self.sampling
        kw = dict(
            temperature=sp.temperature,
            top_k=min(sp.top_k, 255),
            top_p=sp.top_p,
            seed=(sp.seed or 0) + s.index,
            wire_mode=self.wire_mode,
            long_context=self.long_context,
            max_k=self.max_k,
        )
        if self.draft_target is not None:
            stream = self.card.open_stream(target=self.draft_target, **kw)  # type: ignore[arg-type]
        else:
            stream = self.card.open_stream(self.engine, **kw)  # type: ignore[arg-type]
        s.stream, s.card_behind, s.sync_rid = stream, False, None
        stream.prefill(s.tokens)  # the prompt, or after a reconnect everything so far
        return stream

    def _start(self, s: _Sequence, alone: bool = False) -> None:
        """The sequence's first draft. A sequence that starts at K = 0 takes no card stream
        until drafting pays; with ``alone``, one the card has no free stream for starts with
        the target alone (else CardFullError queues it)."""
        t0 = s.started = s.started or time.perf_counter()
        k = s.policy.choose(self._limit(s))
        s.metrics.k_chosen[k] += 1
        s.stream = None
        s.draft, s.card_behind = _NO_DRAFT, True
        if k:
            try:
                s.draft = self._open(s).draft(k)
            except CardFullError:
                if not alone:
                    raise
                self._card_full_at = self._streams_freed
        s.round_start = time.perf_counter()
        s.metrics.card_wait_s += s.round_start - t0

    def _accept(self, s: _Sequence, draft: tuple[int, ...], logits: np.ndarray) -> tuple[int, int]:
        """How many drafted tokens the target accepts, and the token it adds."""
        logits = np.asarray(logits)
        if logits.shape != (len(draft) + 1, self.target.vocab_size):
            raise TargetOutputError(
                f"target returned logits of shape {logits.shape}; expected "
                f"({len(draft) + 1}, {self.target.vocab_size})"
            )
        if self.sampling.greedy:
            return verify_greedy(draft, logits)  # checks the logits it decides by
        if not np.isfinite(logits).all():
            raise TargetOutputError("target returned NaN or infinite logits")
        p = target_probs(logits, self.sampling)
        if s.draft is not None and s.draft.dists is not None:
            return verify_with_distributions(draft, s.draft.dists, p, s.rng)
        return verify_tokens_only(draft, p, s.rng)

    def _emit(
        self, s: _Sequence, draft: tuple[int, ...], n: int, token: int, verify_s: float
    ) -> list[int]:
        """The round's tokens, cut at a stop token or the budget; the target and the
        sequence move on by them."""
        emitted = [*draft[:n], token]
        if s.stops and not s.stops.isdisjoint(emitted):
            for j, t in enumerate(emitted):
                if t in s.stops:
                    emitted, s.finish = emitted[: j + 1], "stop"
                    break
        room = s.max_new_tokens - len(s.generated)
        if len(emitted) >= room and s.finish is None:
            emitted, s.finish = emitted[:room], "length"
        self.target.rollback(s.index, len(s.tokens) + n)
        s.tokens += emitted
        s.generated += emitted
        s.metrics.record_round(len(draft), n, len(emitted))
        s.metrics.verify_s += verify_s
        return emitted

    def _round(self, s: _Sequence, logits: np.ndarray, verify_s: float) -> list[int]:
        assert s.draft is not None
        draft = s.draft.tokens
        n, token = self._accept(s, draft, logits)
        emitted = self._emit(s, draft, n, token, verify_s)
        if s.finish is not None:
            self._finish(s)
            return emitted
        self._advance(s, emitted, n, token)
        if s.metrics.rounds > 1:  # the first verify also processed the whole prompt
            card_wait = s.last_card_wait
            other = max(0.0, s.round_start - s.previous_start - card_wait - verify_s)
            s.policy.observe(len(draft), n, verify_s, other, s.asked_k, card_wait)
        return emitted

    def _plain_burst(self, s: _Sequence, rounds: int) -> Iterator[tuple[_Sequence, list[int]]]:
        """Rounds of the target alone (K = 0) for a lone sequence, as many as the policy is
        sure to choose: the same acceptance and bookkeeping as ``_round``, without a choice,
        a clock reading or a batch built per round. On a target whose step costs a few hundred
        microseconds that per-round machinery would be a visible share of a plain step."""
        target = self.target
        verify_s, done, token = 0.0, 0, 0
        started = time.perf_counter()
        for _ in range(rounds):
            t0 = time.perf_counter()
            logits = target.verify(s.index, s.tokens, ())
            seconds = time.perf_counter() - t0
            verify_s += seconds
            _, token = self._accept(s, (), logits)
            emitted = self._emit(s, (), 0, token, seconds)
            if done:  # the first round's K was chosen (and counted) before the burst
                s.metrics.k_chosen[0] += 1
            done += 1
            yield s, emitted
            if s.finish is not None:
                self._finish(s)
                return
        other = max(0.0, time.perf_counter() - started - verify_s) / done
        s.policy.observe_plain(done, verify_s / done, other)
        self._advance(s, [token], 0, token)

    def _advance(self, s: _Sequence, emitted: list[int], n: int, token: int) -> None:
        """Choose the next K and get the next draft (or none, at K = 0)."""
        k = s.policy.choose(self._limit(s))
        s.metrics.k_chosen[k] += 1
        t0 = time.perf_counter()
        caught_up = s.card_behind or s.stream is None
        try:
            s.draft = self._next_draft(s, n, token, k)
        except DeviceLostError:
            s.draft = None
            raise _StreamLost(emitted) from None
        now = time.perf_counter()
        s.last_card_wait = now - t0
        s.asked_k = 0 if caught_up else k
        s.metrics.card_wait_s += s.last_card_wait
        assert s.draft is not None  # not deferred: a draft, possibly empty
        s.metrics.prefetch_hits += s.draft.prefetch_hit
        s.previous_start, s.round_start = s.round_start, now

    def _next_draft(
        self, s: _Sequence, accepted: int, token: int, k: int, defer: bool = False
    ) -> Draft | None:
        """The draft for the next round. K = 0 is a round of the target alone: no card round
        at all; the card catches up with one PREFILL when drafting pays again. With ``defer``
        a plain round's COMMIT is left to be sent with the others (``commit_plan``; None is
        returned)."""
        stream = s.stream
        if stream is None:  # no stream yet (K was 0, or the card was full): open one now
            if not k or self._card_full_at == self._streams_freed:
                return _NO_DRAFT
            try:
                return self._open(s).draft(k)
            except CardFullError:  # no free stream: the target goes on alone
                s.stream, self._card_full_at = None, self._streams_freed
                return _NO_DRAFT
        if not k:
            s.card_behind = True
            if len(s.tokens) - stream.length >= SYNC_EVERY + (s.sync_rid is not None) * SYNC_EVERY:
                self._settle_sync(s)
                s.sync_rid = stream.send_prefill(s.tokens[stream.length :])
            return _NO_DRAFT
        if not s.card_behind:
            if defer:
                s.commit_plan = (accepted, token, k)
                return None
            return stream.commit(accepted, token, k)  # the one round trip of a round
        self._settle_sync(s)
        if len(s.tokens) > stream.length:
            stream.prefill(s.tokens[stream.length :])
        s.card_behind = False
        return stream.draft(k)

    @staticmethod
    def _settle_sync(s: _Sequence) -> None:
        """Read the reply of the background PREFILL, if one is out."""
        if s.sync_rid is not None and s.stream is not None:
            rid, s.sync_rid = s.sync_rid, None
            s.stream.receive_prefill(rid)

    def _recover(self, active: list[_Sequence]) -> None:
        """The card reset or the link dropped: reconnect, then give every running sequence a
        new stream holding its whole context and a fresh draft. The target decides every
        token, so the output is the same as without the interruption."""
        for attempt in range(RECONNECT_ATTEMPTS):
            try:
                self.card.reconnect()
                for s in active:
                    s.stream = None
                    self._start(s)
                self.reconnects += 1
                return
            except DeviceLostError:
                if attempt + 1 == RECONNECT_ATTEMPTS:
                    raise
                time.sleep(RECONNECT_PAUSE * (attempt + 1))

    def _finish(self, s: _Sequence) -> None:
        if s.finished:
            return
        s.finished = True
        try:
            if s.stream is not None:
                self._settle_sync(s)
                s.stream.close()
                self._streams_freed += 1
        except (DeviceLostError, LinkTimeoutError):
            pass  # every token is already verified; a card frees a lost link's streams
        finally:
            s.stream = None
            self.target.release(s.index)
            if self._batch_k is not None:
                self._batch_k.forget(s.index)
            per_sequence_total = time.perf_counter() - s.started if s.started else 0.0
            s.metrics.total_s = 0.0  # the decoder counts its own wall time
            self.metrics.merge(s.metrics)
            s.metrics.total_s = per_sequence_total
