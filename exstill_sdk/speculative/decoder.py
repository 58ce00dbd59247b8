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
from enum import Enum
from typing import Literal

import numpy as np

from exstill_sdk.errors import (
    CardFullError,
    ContextFullError,
    DeviceLostError,
    ExstillError,
    InvalidArgumentError,
    LinkTimeoutError,
    TargetOutputError,
    TokenizerMismatchError,
    UnknownModelError,
)
from exstill_sdk.interface import CardInterface
from exstill_sdk.metrics.histogram import Histogram
from exstill_sdk.protocol.constants import Features, WireMode
from exstill_sdk.protocol.drafts import NO_DRAFT, Draft, Verdict
from exstill_sdk.protocol.messages import TreeRequest
from exstill_sdk.speculative.acceptance import (
    verify_greedy,
    verify_tokens_only,
    verify_with_distributions,
)
from exstill_sdk.speculative.adapter import TargetAdapter
from exstill_sdk.speculative.adaptive import AdaptiveK, FixedK, KPolicy
from exstill_sdk.speculative.batch_k import BatchK
from exstill_sdk.speculative.metrics import SpecMetrics
from exstill_sdk.speculative.rounds import CatchUp, Commit, KPlanner, PolicyPlanner, exchange
from exstill_sdk.speculative.sampling import SamplingParams, target_probs
from exstill_sdk.speculative.shapes import TreeChooser
from exstill_sdk.speculative.timing import PassClock
from exstill_sdk.speculative.trees import (
    TokenTree,
    drawn_from,
    main_chain_verdict,
    verify_tree_greedy,
    verify_tree_sampled,
)
from exstill_sdk.stream import DraftStream

FinishReason = Literal["stop", "length"]
RECONNECT_ATTEMPTS = 3
RECONNECT_PAUSE = 0.2
SYNC_EVERY = 128
"""While K = 0, the tokens the card has not seen go to it this many at a time, without waiting:
the card takes them in on its own time, so that drafting again costs one short round."""
DEFAULT_TREES = (TreeRequest(8, 2, 6), TreeRequest(15, 2, 8))
"""The trees ``trees="auto"`` measures against the chain (nodes, top-k, depth)."""
TreesOption = Literal["auto", "off"] | TreeRequest | Sequence[TreeRequest]


@dataclass
class GenerationResult:
    tokens: list[int]
    """Generated tokens (the prompt excluded), every one the target's own."""
    finish_reason: FinishReason
    metrics: SpecMetrics


class CardState(Enum):
    """Where a sequence's card stream stands."""

    NONE = "no stream"
    """No stream: the sequence started at K = 0, or the card had no free stream."""
    IN_STEP = "in step"
    """The stream holds the context before the pending draft: one COMMIT moves it on."""
    BEHIND = "behind"
    """The stream lags (rounds at K = 0); its missing tokens go to it in the background
    (``sync_rid``), the rest before its next draft."""


@dataclass
class _Sequence:
    index: int
    max_new_tokens: int
    stops: frozenset[int]
    rng: np.random.Generator
    metrics: SpecMetrics
    tokens: list[int]
    """The context: prompt and every emitted token."""
    generated: list[int] = field(default_factory=list)
    stream: DraftStream | None = None
    card: CardState = CardState.NONE
    draft: Draft = NO_DRAFT
    """The draft the target verifies next (NO_DRAFT: a round of the target alone)."""
    sync_rid: int | None = None
    """A PREFILL sent without waiting (state BEHIND), whose reply is still to be read."""
    round_tokens: int = 0
    """Tokens the last round emitted."""
    round_chain_kept: int | None = None
    """Of the last round, a tree's: the drafted tokens the chain inside it kept."""
    asked: TreeRequest | None = None
    """The tree shape ``draft`` was asked as (the card may answer a tree request with a chain,
    longer than any K); None for a chain's K."""
    finish: FinishReason | None = None
    started: float = 0.0
    finished: bool = False


class SpeculativeDecoder:
    """Speculative decoding with a card and a target.

    ``draft`` names the card's target image to draft with (its tokenizer must be the
    target's); without it, the card's built-in ``engine`` (prompt lookup by default) drafts.
    ``k`` is a fixed draft length, ``"adaptive"`` (see exstill_sdk.speculative.adaptive), or a
    ``KPolicy`` of the caller's, which then chooses K for rounds of one sequence.

    ``trees``: ``"off"`` (the default) drafts chains only. Where trees can run (a target that
    scores trees, a card with Features.TREES; sampled decoding also needs DIST wire mode and
    Features.SAMPLED_TREES), ``"auto"`` lets a lone sequence measure the steady chain against
    ``DEFAULT_TREES`` and draft the shape that gives the most tokens a second
    (``TreeChooser``; a batch drafts chains); one ``TreeRequest``
    fixes the tree for every sequence, batches included (their trees and chains scored in one
    pass, ``TargetAdapter.verify_drafts``), several are the candidates. ``tree_note`` says why
    trees do not run where they do not. ``"auto"`` is not the default: on the demo pair a tree
    does not pay, and auto is level with the chain only within noise (docs/benchmarks.md, "One
    user, the shape chosen").
    """

    def __init__(
        self,
        card: CardInterface,
        target: TargetAdapter,
        *,
        draft: str | None = None,
        engine: str | None = None,
        sampling: SamplingParams | None = None,
        k: int | Literal["adaptive"] | KPolicy = "adaptive",
        max_k: int = 8,
        wire_mode: WireMode = WireMode.DIST,
        long_context: bool = False,
        trees: TreesOption = "off",
    ) -> None:
        self.card = card
        self.target = target
        self.sampling = sampling or SamplingParams()
        if not isinstance(max_k, int) or max_k < 0:
            raise InvalidArgumentError(f"max_k must be a whole number 0 or more, not {max_k!r}")
        self.max_k = min(max_k, card.info().max_k)
        fixed = isinstance(k, int) and 0 <= k <= self.max_k
        if not (k == "adaptive" or isinstance(k, KPolicy) or fixed):
            raise InvalidArgumentError(
                f"k must be 0..{self.max_k}, 'adaptive' or a KPolicy, not {k!r}"
            )
        self.k = k
        self.wire_mode = wire_mode
        self.long_context = long_context
        self.draft_target = draft
        self.engine = engine
        if draft is not None:
            self._check_target(draft)
        self.metrics = SpecMetrics(max_k=self.max_k)
        self._policy = (
            k
            if isinstance(k, KPolicy)
            else AdaptiveK(self.max_k)
            if k == "adaptive"
            else FixedK(int(k))
        )
        """One policy for every sequence of this decoder (what a round costs is the target's
        and the card's, not a sequence's, and it is learnt once); it plans rounds of one
        sequence, and every round at a fixed K."""
        self._single = PolicyPlanner(self._policy)
        self._batch: KPlanner = BatchK(self.max_k) if k == "adaptive" else self._single
        """K for rounds of several sequences (one pass over the target for all of them)."""
        self._clock = PassClock()
        self._planner: KPlanner | None = None
        """The planner of the last round: the pass timing goes to the planner that ran the
        round before it."""
        self._streams_freed = 0
        self._card_full_at = -1
        """``_streams_freed`` when the card last refused a stream: sequences without one ask
        again only after this decoder has freed one."""
        self.reconnects = 0
        """Times the decoder re-established the card link and re-opened its streams."""
        self.streams_opened = 0
        self.streams_refused = 0
        """Streams the card opened for this decoder, and refused (CARD_FULL)."""
        self.round_trips = Histogram()
        """Seconds of each round's card half (its COMMITs and catch-ups, sent and answered)."""
        self._next_index = 0
        self.tree_note = ""
        self._trees = self._tree_chooser(trees)
        self._arm: tuple[int, int, float] | None = None
        """The last single-sequence round's shape: (sequence, arm, when it was chosen)."""

    def _tree_chooser(self, trees: TreesOption) -> TreeChooser | None:
        if trees == "off":
            self.tree_note = "trees off"
            return None
        if trees == "auto":
            candidates: Sequence[TreeRequest] = DEFAULT_TREES
        elif isinstance(trees, TreeRequest):
            candidates = [trees]
        elif not isinstance(trees, str) and all(isinstance(t, TreeRequest) for t in trees):
            candidates = list(trees)
        else:
            raise InvalidArgumentError(
                f"trees must be 'auto', 'off', a TreeRequest or a list of them, not {trees!r}"
            )
        features = self.card.info().features
        if not self.sampling.greedy and self.wire_mode != WireMode.DIST:
            self.tree_note = "chains only: sampled trees need their distributions (DIST mode)"
        elif not self.sampling.greedy and not features & Features.SAMPLED_TREES:
            self.tree_note = "chains only: the card drafts trees for greedy decoding only"
        elif not self.target.supports_trees:
            self.tree_note = f"chains only: {type(self.target).__name__} does not score trees"
        elif not features & Features.TREES:
            self.tree_note = "chains only: the card does not draft trees"
        if self.tree_note:
            return None
        return TreeChooser(candidates, fixed=isinstance(trees, TreeRequest))

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
        tokens = [int(t) for t in prompt]
        return _Sequence(index, max_new_tokens, stops, rng, SpecMetrics(max_k=self.max_k), tokens)

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
            limit = self.target.max_positions
            if limit and len(p) + max_new_tokens > limit:
                raise InvalidArgumentError(
                    f"prompt of {len(p)} tokens + {max_new_tokens} new ones exceed the "
                    f"target's {limit} positions (its max_position_embeddings); shorten them"
                )
            capacity = self.card.info().context
            if not self.long_context and len(p) + max_new_tokens > capacity:
                remedy = (
                    "use long_context=True"
                    if self.draft_target is not None
                    else "draft with a target image on the card (draft=..., long_context=True): "
                    "built-in engines have no long-context mode"
                )
                raise ContextFullError(
                    f"prompt of {len(p)} tokens + {max_new_tokens} new ones exceed the card's "
                    f"{capacity}-token slot; shorten them or {remedy}"
                )
        pending = deque(self._new_sequence(p, max_new_tokens, stops) for p in prompts)
        if sink is not None:
            sink.update({s.index: s for s in pending})
        active: list[_Sequence] = []
        started = time.perf_counter()
        self._clock.reset()
        try:
            while pending or active:
                while pending:
                    try:
                        batch = bool(active) or len(pending) > 1
                        # with nothing running to wait for, a full card means the target alone
                        alone = not active or (batch and len(active) < self.target.max_batch)
                        self._start(pending[0], alone)
                    except CardFullError:
                        break  # wait for a running sequence to free its stream
                    except DeviceLostError:
                        self._recover(active)
                        continue
                    active.append(pending.popleft())
                if len(active) == 1 and not pending and active[0].draft is NO_DRAFT:
                    burst = self._policy.plain_rounds()
                    if burst > 1:
                        try:
                            yield from self._plain_burst(active[0], burst)
                        except DeviceLostError:
                            self._recover(active)
                        active = [s for s in active if s.finish is None]
                        continue
                lost = yield from self._round(active)
                active = [s for s in active if s.finish is None]
                if lost:
                    self._recover(active)
        finally:
            for s in active + list(pending):
                self._finish(s)
            elapsed = time.perf_counter() - started
            self.metrics.total_s += elapsed

    def _round(self, active: list[_Sequence]) -> Generator[tuple[_Sequence, list[int]], None, bool]:
        """One round of every active sequence: one verification pass for all, each one's
        verdict and emitted tokens, then the next drafts (rounds.py). Returns whether the card
        was lost (every verified token still counts)."""
        planner = self._single if len(active) == 1 else self._batch
        if planner is not self._planner:
            self._clock.reset()
            self._planner = planner
        if any(s.asked is not None for s in active):
            all_logits, each = self._verify_with_trees(active)
        else:
            steady = all(s.metrics.rounds for s in active)  # no prompt in this pass
            self._clock.begin_pass(sum(len(s.draft.tokens) + 1 for s in active))
            all_logits = self.target.verify_batch(
                [(s.index, s.tokens, s.draft.tokens) for s in active]
            )
            timing = self._clock.end_pass(steady)
            planner.observe_pass(timing)
            each = timing.pass_s / len(active)
        going: list[tuple[_Sequence, Verdict]] = []
        for s, logits in zip(active, all_logits, strict=True):
            tree = s.draft.parents is not None
            verdict = self._accept_tree(s, logits) if tree else self._accept(s, logits)
            emitted = self._emit(s, verdict, each)
            if s.asked is None:  # the chain planner learns from the chains of its K
                planner.observe_round(s.index, len(s.draft.tokens), verdict.accepted)
            elif s.draft.parents is not None:  # and the text from the chain inside a tree
                k, accepted = main_chain_verdict(s.draft.parents, verdict.path)
                planner.observe_round(s.index, k, accepted, timed=False)
                s.round_chain_kept = accepted
            yield s, emitted
            if s.finish is None:
                going.append((s, verdict))
            else:
                self._finish(s)
        try:
            self._next_drafts(going, planner)
        except DeviceLostError:
            return True
        return False

    def _verify_with_trees(self, active: list[_Sequence]) -> tuple[list[np.ndarray], float]:
        """A round in which some drafts were asked as trees: every chain and tree scored by
        the target's ``verify_drafts`` (one pass where the target can); the chain planner's
        clock does not time it."""
        self._clock.reset()
        t0 = time.perf_counter()
        items = [
            (
                s.index,
                s.tokens,
                s.draft.tokens
                if s.draft.parents is None
                else TokenTree(s.draft.tokens, s.draft.parents),
            )
            for s in active
        ]
        return self.target.verify_drafts(items), (time.perf_counter() - t0) / len(active)

    def _shape(self, s: _Sequence, k: int) -> int | TreeRequest:
        """A lone sequence's next draft: the chain of ``k`` or a tree (``TreeChooser``), and
        the last round's tokens a second go to the shape that drafted it."""
        chooser, now = self._trees, time.perf_counter()
        assert chooser is not None
        if self._arm is not None and self._arm[0] == s.index:
            chooser.observe(self._arm[1], s.round_tokens, now - self._arm[2], s.round_chain_kept)
        self._arm, s.round_chain_kept = None, None
        if not k:
            return k
        policy = self._policy
        arm = chooser.choose(policy.expected_rate(), policy.verify_seconds, policy.chain_rounds())
        shape = chooser.arms[arm]
        if shape is not None and not self._tree_fits(s, shape):
            return k
        self._arm = (s.index, arm, now)
        s.metrics.shapes_chosen[chooser.describe(arm)] += 1
        return k if shape is None else shape

    def _next_drafts(self, going: list[tuple[_Sequence, Verdict]], planner: KPlanner) -> None:
        """Choose the sequences' next K together (for a lone sequence, perhaps a tree instead)
        and bring the card along: COMMITs for the streams in step (sent together), catch-ups
        for the rest, no card round at K = 0."""
        seqs = [s for s, _ in going]
        ks = planner.choose([s.index for s in seqs], [self._limit(s) for s in seqs])
        shapes: list[int | TreeRequest] = list(ks)
        if self._trees is not None and len(going) == 1:
            shapes[0] = self._shape(seqs[0], ks[0])
        else:
            self._arm = None
            if self._trees is not None and self._trees.fixed:  # a fixed tree: every sequence's
                shapes = [self._fixed_tree(s, k) for s, k in zip(seqs, ks, strict=True)]
        steps: list[Commit | CatchUp] = []
        owners: list[_Sequence] = []
        for (s, verdict), k in zip(going, shapes, strict=True):
            if isinstance(k, int):
                s.metrics.k_chosen[k] += 1
            s.draft, s.asked = NO_DRAFT, None
            step = self._card_step(s, verdict, k)
            if step is not None:
                steps.append(step)
                owners.append(s)
                s.asked = k if isinstance(k, TreeRequest) else None
        t0 = time.perf_counter()
        results = exchange(self.card, steps) if steps else []
        card_s = time.perf_counter() - t0
        if steps:
            self.round_trips.observe(card_s)
        lost: DeviceLostError | None = None
        for s, result in zip(owners, results, strict=True):
            if isinstance(result, DeviceLostError):
                lost = result  # the sequence's stream is gone with its card: _recover
                continue
            if isinstance(result, ExstillError):
                raise result
            s.draft, s.card = result, CardState.IN_STEP
            s.metrics.prefetch_hits += result.prefetch_hit
        for s in seqs:
            s.metrics.card_wait_s += card_s / len(seqs)
        catch_up = any(isinstance(step, CatchUp) for step in steps)
        trees = any(isinstance(k, TreeRequest) for k in shapes)
        self._clock.card(card_s, None if catch_up or trees else sum(ks))
        if lost is not None:
            raise lost

    def _card_step(
        self, s: _Sequence, verdict: Verdict, k: int | TreeRequest
    ) -> Commit | CatchUp | None:
        """What the card must do for the sequence's next draft of ``k`` tokens; None when
        nothing is drafted (K = 0 is a round of the target alone: no card round at all; the
        card catches up when drafting pays again)."""
        stream = s.stream
        if stream is None:  # no stream yet (K was 0, or the card was full): open one now
            if not k or self._card_full_at == self._streams_freed:
                return None
            try:
                stream = self._open(s)
            except CardFullError:  # no free stream: the target goes on alone
                self._card_full_at = self._streams_freed
                return None
            return CatchUp(stream, s.tokens, k)
        if not k:
            s.card = CardState.BEHIND
            behind = len(s.tokens) - stream.length
            if behind >= SYNC_EVERY + (s.sync_rid is not None) * SYNC_EVERY:
                self._settle_sync(s)
                s.sync_rid = stream.send_prefill(s.tokens[stream.length :])
            return None
        if s.card is CardState.IN_STEP:
            return Commit(stream, verdict, k)  # the one round trip of a round
        self._settle_sync(s)
        return CatchUp(stream, s.tokens[stream.length :], k)

    def _fixed_tree(self, s: _Sequence, k: int) -> int | TreeRequest:
        """A sequence of a batch under a fixed tree: the tree where the round drafts and it
        fits, else the chain of ``k``."""
        assert self._trees is not None
        shape = self._trees.arms[1]
        if not k or shape is None or not self._tree_fits(s, shape):
            return k
        s.metrics.shapes_chosen[self._trees.describe(1)] += 1
        return shape

    def _tree_fits(self, s: _Sequence, shape: TreeRequest) -> bool:
        """Whether the budget, the card's slot and the target have room for the tree (near the
        end of a sequence they may not)."""
        positions = self.target.max_positions
        fits_target = not positions or len(s.tokens) + shape.nodes < positions
        return self._room(s) >= shape.levels and fits_target

    def _room(self, s: _Sequence) -> int:
        """Drafted tokens a round may keep: the budget's room and the slot's."""
        room = s.max_new_tokens - len(s.generated) - 1
        if s.stream is not None and not self.long_context:
            room = min(room, s.stream.capacity - s.stream.length - 1)
        return room

    def _limit(self, s: _Sequence) -> int:
        """The largest useful K: the card's, the budget's and the slot's."""
        if s.stream is None and self._card_full_at == self._streams_freed:
            return 0  # the card refused a stream and none has been freed since
        return max(0, min(self.max_k, self._room(s)))

    def _open(self, s: _Sequence) -> DraftStream:
        """A card stream for the sequence, empty (it catches up with the context next)."""
        try:
            stream = self._open_stream(s)
        except CardFullError:
            self.streams_refused += 1
            raise
        self.streams_opened += 1
        s.stream, s.card, s.sync_rid = stream, CardState.BEHIND, None
        return stream

    def _open_stream(self, s: _Sequence) -> DraftStream:
        """The card's OPEN with the decoder's drafting settings and the sequence's seed."""
        sp = self.sampling
        return self.card.open_stream(
            None if self.draft_target is not None else self.engine,
            target=self.draft_target,
            temperature=sp.temperature,
            top_k=min(sp.top_k, 255),
            top_p=sp.top_p,
            seed=(sp.seed or 0) + s.index,
            wire_mode=self.wire_mode,
            long_context=self.long_context,
            max_k=self.max_k,
        )

    def _start(self, s: _Sequence, alone: bool = False) -> None:
        """The sequence's first draft. A sequence that starts at K = 0 takes no card stream
        until drafting pays; with ``alone``, one the card has no free stream for starts with
        the target alone (else CardFullError queues it)."""
        s.started = s.started or time.perf_counter()
        self._policy.start_sequence()
        if self._trees is not None:
            self._trees.start()
        self._draft_anew(s, alone)

    def _draft_anew(self, s: _Sequence, alone: bool) -> None:
        """A new stream (if the K chosen drafts) that takes in the sequence's whole context,
        and its first draft: a sequence's start, or its restart after its card was lost."""
        t0 = time.perf_counter()
        k = self._policy.choose(self._limit(s))
        s.metrics.k_chosen[k] += 1
        s.stream, s.card, s.draft, s.asked = None, CardState.NONE, NO_DRAFT, None
        if k:
            try:
                stream = self._open(s)
            except CardFullError:
                if not alone:
                    raise
                self._card_full_at = self._streams_freed
            else:
                fixed = self._trees is not None and self._trees.fixed
                shape = self._fixed_tree(s, k) if fixed else k  # a fixed tree from the start
                (result,) = exchange(self.card, [CatchUp(stream, s.tokens, shape)])
                if isinstance(result, ExstillError):
                    raise result
                s.draft, s.card = result, CardState.IN_STEP
                s.asked = shape if isinstance(shape, TreeRequest) else None
        s.metrics.card_wait_s += time.perf_counter() - t0

    def _accept(self, s: _Sequence, logits: np.ndarray) -> Verdict:
        """The target's verdict on the sequence's draft."""
        draft = s.draft
        logits = np.asarray(logits)
        if logits.shape != (len(draft.tokens) + 1, self.target.vocab_size):
            raise TargetOutputError(
                f"target returned logits of shape {logits.shape}; expected "
                f"({len(draft.tokens) + 1}, {self.target.vocab_size})"
            )
        if self.sampling.greedy:
            return verify_greedy(draft.tokens, logits)  # checks the logits it decides by
        p = self._sampled_probs(logits)
        if draft.dists is not None:
            return verify_with_distributions(draft.tokens, draft.dists, p, s.rng)
        return verify_tokens_only(draft.tokens, p, s.rng)

    def _sampled_probs(self, logits: np.ndarray) -> np.ndarray:
        """The target's sampling probabilities from its logits, refusing NaN or infinity."""
        if not np.isfinite(logits).all():
            raise TargetOutputError("target returned NaN or infinite logits")
        return target_probs(logits, self.sampling)

    def _accept_tree(self, s: _Sequence, logits: np.ndarray) -> Verdict:
        """The target's verdict on the sequence's tree draft (greedy, or recursive rejection
        sampling over the siblings the card drew); its cache keeps the path."""
        draft = s.draft
        assert draft.parents is not None
        logits = np.asarray(logits)
        if logits.shape != (len(draft.tokens) + 1, self.target.vocab_size):
            raise TargetOutputError(
                f"target returned tree logits of shape {logits.shape}; expected "
                f"({len(draft.tokens) + 1}, {self.target.vocab_size})"
            )
        tree = TokenTree(draft.tokens, draft.parents)
        if self.sampling.greedy:
            nodes, token = verify_tree_greedy(tree, logits)
        else:
            p = self._sampled_probs(logits)
            q = drawn_from(tree, draft.dists, self.target.vocab_size)
            nodes, token = verify_tree_sampled(tree, p, q, s.rng)
        self.target.keep_path(s.index, tree, nodes)
        return Verdict(len(nodes), token, tuple(nodes))

    def _emit(self, s: _Sequence, verdict: Verdict, verify_s: float) -> list[int]:
        """The round's tokens, cut at a stop token or the budget; the target and the
        sequence move on by them."""
        emitted = s.draft.kept(verdict)
        if s.stops and not s.stops.isdisjoint(emitted):
            for j, t in enumerate(emitted):
                if t in s.stops:
                    emitted, s.finish = emitted[: j + 1], "stop"
                    break
        room = s.max_new_tokens - len(s.generated)
        if len(emitted) >= room and s.finish is None:
            emitted, s.finish = emitted[:room], "length"
        self.target.rollback(s.index, len(s.tokens) + verdict.accepted)
        s.tokens += emitted
        s.generated += emitted
        s.metrics.record_round(
            len(s.draft.tokens), verdict.accepted, len(emitted), s.asked is not None
        )
        s.round_tokens = len(emitted)
        s.metrics.verify_s += verify_s
        return emitted

    def _plain_burst(self, s: _Sequence, rounds: int) -> Iterator[tuple[_Sequence, list[int]]]:
        """Rounds of the target alone (K = 0) for a lone sequence, as many as the policy is
        sure to choose: the same acceptance and bookkeeping as a round, without a choice, a
        clock reading or a batch built per round. On a target whose step costs a few hundred
        microseconds that per-round machinery would be a visible share of a plain step."""
        target = self.target
        verify_s, done = 0.0, 0
        verdict = Verdict(0, 0)
        self._arm = None
        started = time.perf_counter()
        for _ in range(rounds):
            t0 = time.perf_counter()
            logits = target.verify(s.index, s.tokens, ())
            seconds = time.perf_counter() - t0
            verify_s += seconds
            verdict = self._accept(s, logits)
            emitted = self._emit(s, verdict, seconds)
            if done:  # the first round's K was chosen (and counted) before the burst
                s.metrics.k_chosen[0] += 1
            done += 1
            yield s, emitted
            if s.finish is not None:
                self._finish(s)
                return
        other = max(0.0, time.perf_counter() - started - verify_s) / done
        self._policy.observe_plain(done, verify_s / done, other)
        self._clock.reset()
        self._next_drafts([(s, verdict)], self._single)

    @staticmethod
    def _settle_sync(s: _Sequence) -> None:
        """Read the reply of the background PREFILL, if one is out."""
        if s.sync_rid is not None and s.stream is not None:
            rid, s.sync_rid = s.sync_rid, None
            s.stream.receive_prefill(rid)

    def _recover(self, active: list[_Sequence]) -> None:
        """A card reset or a link dropped: reconnect (a pool reconnects or sets aside the
        cards lost), then give every sequence whose stream was lost a new stream holding its
        whole context and a fresh draft (the target alone where no stream is free). The target
        decides every token, so the output is the same as without the interruption."""
        for attempt in range(RECONNECT_ATTEMPTS):
            try:
                self.card.reconnect()
                for s in active:
                    if s.stream is not None and s.stream.closed:
                        s.sync_rid = None
                        self._draft_anew(s, alone=True)
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
            s.stream, s.card = None, CardState.NONE
            self.target.release(s.index)
            self._batch.forget(s.index)
            per_sequence_total = time.perf_counter() - s.started if s.started else 0.0
            s.metrics.total_s = 0.0  # the decoder counts its own wall time
            self.metrics.merge(s.metrics)
            s.metrics.total_s = per_sequence_total
