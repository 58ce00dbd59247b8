"""SpeculativeDecoder: the card drafts, the target verifies, the user gets the target's tokens.

One round per sequence: the target scores the card's draft (one call, K + 1 positions), the
acceptance rule picks the accepted prefix and the target's next token, and one COMMIT tells the
card (accepted count, that token, next K) and brings back the next draft, which the card may
already have drafted ahead while the target was verifying. Sequences beyond the card's free
streams wait in a queue; a finished sequence frees its stream at once.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from exstill_sdk.card import Card, Draft, DraftStream
from exstill_sdk.errors import (
    CardFullError,
    ContextFullError,
    DeviceLostError,
    InvalidArgumentError,
    TargetOutputError,
    TokenizerMismatchError,
    UnknownModelError,
)
from exstill_sdk.protocol.constants import WireMode
from exstill_sdk.spec.acceptance import (
    verify_greedy,
    verify_tokens_only,
    verify_with_distributions,
)
from exstill_sdk.spec.adapter import TargetAdapter
from exstill_sdk.spec.adaptive import AdaptiveK, FixedK
from exstill_sdk.spec.metrics import SpecMetrics
from exstill_sdk.spec.sampling import SamplingParams, target_probs

FinishReason = Literal["stop", "length"]
RECONNECT_ATTEMPTS = 3
RECONNECT_PAUSE = 0.2


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
    policy: AdaptiveK | FixedK
    rng: np.random.Generator
    metrics: SpecMetrics
    tokens: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    stream: DraftStream | None = None
    draft: Draft | None = None
    finish: FinishReason | None = None
    round_start: float = 0.0
    started: float = 0.0


class SpeculativeDecoder:
    """Speculative decoding with a card and a target.

    ``draft`` names the card's target image to draft with (its tokenizer must be the
    target's); without it, the card's built-in ``engine`` (prompt lookup by default) drafts.
    ``k`` is a fixed draft length or ``"adaptive"`` (see exstill_sdk.spec.adaptive).
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
        policy: AdaptiveK | FixedK = (
            AdaptiveK(self.max_k) if self.k == "adaptive" else FixedK(int(self.k))
        )
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
        try:
            while pending or active:
                while pending:
                    try:
                        self._start(pending[0])
                    except CardFullError:
                        if not active:
                            raise
                        break  # wait for a running sequence to free its stream
                    except DeviceLostError:
                        self._recover(active)
                        continue
                    active.append(pending.popleft())
                items = [(s.index, s.tokens, list(s.draft.tokens)) for s in active]  # type: ignore[union-attr]
                t0 = time.perf_counter()
                all_logits = self.target.verify_batch(items)
                verify_each = (time.perf_counter() - t0) / len(active)
                lost = False
                for s, logits in zip(active, all_logits, strict=True):
                    try:
                        emitted = self._round(s, logits, verify_each)
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

    def _limit(self, s: _Sequence) -> int:
        """The largest useful K: the card's, the budget's and the slot's."""
        remaining = s.max_new_tokens - len(s.generated) - 1
        limit = min(self.max_k, remaining)
        if s.stream is not None and not self.long_context:
            limit = min(limit, s.stream.capacity - s.stream.length - 1)
        return max(0, limit)

    def _start(self, s: _Sequence) -> None:
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
        t0 = s.started = time.perf_counter()
        if self.draft_target is not None:
            s.stream = self.card.open_stream(target=self.draft_target, **kw)  # type: ignore[arg-type]
        else:
            s.stream = self.card.open_stream(self.engine, **kw)  # type: ignore[arg-type]
        s.stream.prefill(s.tokens)  # the prompt, or after a reconnect everything so far
        k = s.policy.choose(self._limit(s))
        s.metrics.k_chosen[k] += 1
        s.draft = s.stream.draft(k)
        s.round_start = time.perf_counter()
        s.metrics.card_wait_s += s.round_start - t0

    def _round(self, s: _Sequence, logits: np.ndarray, verify_s: float) -> list[int]:
        assert s.draft is not None and s.stream is not None
        draft = list(s.draft.tokens)
        logits = np.asarray(logits)
        if logits.shape != (len(draft) + 1, self.target.vocab_size):
            raise TargetOutputError(
                f"target returned logits of shape {logits.shape}; expected "
                f"({len(draft) + 1}, {self.target.vocab_size})"
            )
        if not np.isfinite(logits).all():
            raise TargetOutputError("target returned NaN or infinite logits")
        if self.sampling.greedy:
            n, token = verify_greedy(draft, logits)
        else:
            p = target_probs(logits, self.sampling)
            if s.draft.dists is not None:
                n, token = verify_with_distributions(draft, s.draft.dists, p, s.rng)
            else:
                n, token = verify_tokens_only(draft, p, s.rng)
        emitted = [*draft[:n], token]
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
        if s.finish is not None:
            self._finish(s)
            return emitted
        k = s.policy.choose(self._limit(s))
        s.metrics.k_chosen[k] += 1
        t0 = time.perf_counter()
        try:
            s.draft = s.stream.commit(n, token, k)
        except DeviceLostError:
            s.draft = None
            raise _StreamLost(emitted) from None
        now = time.perf_counter()
        card_wait = now - t0
        s.metrics.card_wait_s += card_wait
        s.metrics.prefetch_hits += s.draft.prefetch_hit
        if s.metrics.rounds > 1:  # the first verify also processed the whole prompt
            other = max(0.0, now - s.round_start - card_wait - verify_s)
            s.policy.observe(len(draft), n, card_wait, verify_s, other)
        s.round_start = now
        return emitted

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
        if s.stream is not None:
            try:
                s.stream.close()
            finally:
                s.stream = None
                self.target.release(s.index)
                s.metrics.total_s = time.perf_counter() - s.started
                per_sequence_total = s.metrics.total_s
                s.metrics.total_s = 0.0  # the decoder counts its own wall time
                self.metrics.merge(s.metrics)
                s.metrics.total_s = per_sequence_total
