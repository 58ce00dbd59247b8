"""A draft model with prompt lookup in front: where the stream's text repeats (its latest
``min_n``..``max_n``-gram occurred before), the tokens that followed it last time; elsewhere the
model's draft. Streams opened with ``OpenFlags.LOOKUP`` draft this way.

Text that repeats itself (code, a table, a quoted passage, or a small target's greedy loops) is
drafted better by lookup than by any small model, and lookup costs nothing; elsewhere lookup
has nothing to offer and the model drafts. Both keep the committed context: the model's cache
follows every committed token, whichever drafted it, so it is ready the moment the text stops
repeating. Lookup drafts are deterministic (no distribution), as the lookup engine's are.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence

from exstill_sdk.protocol.messages import TreeRequest

from .base import DraftEngine, EngineState, OutcomeDraft, Proposal, Sampling, TreeProposal
from .lookup import LookupEngine

MIN_N = 3
MAX_N = 6
"""The n-grams a lookup draft needs: longer than the lookup engine's own 2 (a model is there
to draft where a short match is weak evidence)."""


class HybridState(EngineState):
    """One stream: the model's state and the lookup index over the same committed tokens."""

    def __init__(self, engine: HybridEngine, model: EngineState, lookup: EngineState) -> None:
        self.engine = engine
        self.model = model
        self.lookup = lookup

    @property
    def length(self) -> int:
        return self.model.length

    @property  # type: ignore[override]
    def keep_logits(self) -> bool:
        return self.model.keep_logits

    @keep_logits.setter
    def keep_logits(self, keep: bool) -> None:
        self.model.keep_logits = keep

    def draft_outcomes(
        self,
        pending: bytes,
        roots: Sequence[tuple[int, int]],
        count: int,
        stop: Callable[[], bool],
    ) -> list[OutcomeDraft] | None:
        """The model's, for a draft the model made (lookup's drafts keep no logits, so the
        card does not ask), and only for outcomes after which lookup has nothing: where it
        has, the draft after that outcome is lookup's."""
        roots = [
            (j, b)
            for j, b in roots
            if not self.lookup.propose(1, pending[: 4 * j] + struct.pack("<I", b)).tokens
        ]
        return self.model.draft_outcomes(pending, roots, count, stop) if roots else None

    def adopt_outcome(self, draft: OutcomeDraft) -> None:
        self.model.adopt_outcome(draft)

    def finish_draft(self, k: int, made: bytes) -> Proposal:
        """The model's: the draft begun ahead was the model's (lookup had nothing there)."""
        return self.model.finish_draft(k, made)

    def extend(self, tokens: bytes) -> None:
        self.model.extend(tokens)
        self.lookup.extend(tokens)

    def truncate(self, length: int) -> None:
        self.model.truncate(length)  # the one that may refuse, changing nothing
        self.lookup.truncate(length)

    def propose(self, k: int, branch: bytes = b"") -> Proposal:
        return self.engine.propose_many([(self, k, branch)])[0]

    def propose_tree(self, shape: TreeRequest) -> TreeProposal:
        """Lookup's tree (several matches as branches) where the text repeats, else the
        model's."""
        found = self.lookup.propose_tree(shape)
        if found.tokens:
            return found._replace(lookup=True)
        return self.model.propose_tree(shape)

    def close(self) -> None:
        self.model.close()
        self.lookup.close()


class HybridEngine(DraftEngine):
    """``model`` with prompt lookup in front (module docstring); named and typed as the model,
    whose vocabulary and tokenizer it drafts over."""

    supports_long_context = False

    def __init__(self, model: DraftEngine, min_n: int = MIN_N, max_n: int = MAX_N) -> None:
        self.model = model
        self.lookup = LookupEngine(min_n, max_n)
        self.name = model.name
        self.kind = model.kind
        self.vocab_size = model.vocab_size
        self.tokenizer_sha256 = model.tokenizer_sha256
        self.rank_temperature = model.rank_temperature

    def open_state(
        self, capacity: int, sampling: Sampling, long_context: bool = False
    ) -> HybridState:
        self.check_long_context(long_context)
        lookup = self.lookup.open_state(capacity, sampling)
        return HybridState(self, self.model.open_state(capacity, sampling), lookup)

    def propose_many(self, jobs: Sequence[tuple[EngineState, int, bytes]]) -> list[Proposal]:
        """Lookup's draft for the streams whose text repeats; the model drafts the others
        together."""
        out: list[Proposal] = []
        rest: list[tuple[int, tuple[EngineState, int, bytes]]] = []
        for i, (state, k, branch) in enumerate(jobs):
            assert isinstance(state, HybridState)
            found = state.lookup.propose(k, branch) if k else Proposal(b"")
            out.append(Proposal(found.tokens, lookup=True) if found.tokens else found)
            if not found.tokens:
                rest.append((i, (state.model, k, branch)))
        if rest:
            drafted = self.model.propose_many([job for _, job in rest])
            for (i, _), proposal in zip(rest, drafted, strict=True):
                out[i] = proposal
        return out
