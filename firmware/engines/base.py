"""The engine interface: what the runtime asks of any draft engine.

Token ids travel as little-endian u32 bytes, the wire format, from the commit frame into the
context and from a proposal into the reply frame, without a per-token conversion.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from exstill_sdk.errors import InvalidArgumentError
from exstill_sdk.image.reader import DEFAULT_RANK_TEMPERATURE
from exstill_sdk.protocol.constants import TREE_ROOT, ModelKind
from exstill_sdk.protocol.messages import Distribution, TreeRequest
from exstill_sdk.support.sampling import SamplingParams


@dataclass(frozen=True)
class Sampling(SamplingParams):
    """A stream's sampling parameters (the host's SamplingParams, checked the same way; a
    stream's seed is always a number), plus how many tokens the card may send of each
    position's distribution."""

    seed: int | None = 0
    max_entries: int = 0
    """Most tokens the sampled distribution may keep (0: no limit). DIST wire mode sets 255,
    so that the distribution sent is the whole distribution sampled from."""


class Proposal(NamedTuple):
    tokens: bytes
    """Drafted token ids, u32 little-endian; may be shorter than asked."""
    dists: tuple[Distribution, ...] | None = None
    """The distribution each token was sampled from; None for deterministic drafts."""
    lookup: bool = False
    """Prompt lookup drafted it inside a model's stream (engines/hybrid.py): the reply says so
    (DraftFlags.LOOKUP)."""
    logits: np.ndarray | None = None
    """[tokens, vocab]: row i the logits token i+1 was chosen from, kept when the engine was
    asked to (``keep_logits``) so that the card can draft ahead for other outcomes
    (firmware/outcomes.py); None otherwise."""


class OutcomeDraft(NamedTuple):
    """A draft made ahead for one verification outcome of the pending draft: its first ``j``
    tokens accepted and the target's token ``b`` after them."""

    committed: bytes
    """What the COMMIT of that outcome commits: the first j drafted tokens and b (u32 LE)."""
    proposal: Proposal
    """What drafting after it gives: tokens (and distributions, logits)."""
    nodes: tuple[int, ...]
    """The engine's own record of where the draft's cache entries are (``adopt_outcome``)."""


class TreeProposal(NamedTuple):
    tokens: bytes
    """Drafted token ids, u32 little-endian, a parent before its children."""
    parents: bytes
    """Each node's parent, u8 (TREE_ROOT: the context)."""
    lookup: bool = False
    dists: tuple[Distribution, ...] | None = None
    """A sampled stream's tree: per node, the distribution it was drawn from (siblings share
    their parent's: they were drawn from it one after another, without replacement)."""


def chain_parents(n: int) -> bytes:
    """The wire parents of a chain of ``n`` tokens: each node's parent the one before."""
    return bytes([TREE_ROOT, *range(n - 1)]) if n else b""


class EngineState(ABC):
    """One stream's state inside an engine. ``propose`` may run on the prefetch worker while
    the runtime serves other streams; an engine whose ``propose`` writes shared state (the
    transformer's KV cache) serialises it itself."""

    keep_logits: bool = False
    """Proposals keep their logits (``Proposal.logits``) where the engine has them: the card
    drafts ahead for several outcomes (firmware/outcomes.py)."""

    @property
    @abstractmethod
    def length(self) -> int:
        """Committed tokens (absolute, including any an engine has evicted)."""

    @abstractmethod
    def extend(self, tokens: bytes) -> None:
        """Append committed tokens (u32 LE)."""

    @abstractmethod
    def truncate(self, length: int) -> None:
        """Cut the committed context back to ``length`` tokens; raises (changing nothing) when
        the engine cannot."""

    @abstractmethod
    def propose(self, k: int, branch: bytes = b"") -> Proposal:
        """Draft up to ``k`` tokens after the context followed by ``branch`` (u32 LE tokens
        not committed yet: the prefetch worker drafts ahead on a guessed outcome)."""

    def propose_tree(self, shape: TreeRequest) -> TreeProposal:
        """Draft a token tree after the context: up to ``shape.nodes`` nodes, each with at
        most ``shape.top_k`` children, at most ``shape.depth`` deep (0: no limit). An engine
        that drafts chains only gives its chain of ``min(nodes, depth)`` tokens, a tree too."""
        proposal = self.propose(shape.levels)
        parents = chain_parents(len(proposal.tokens) >> 2)
        return TreeProposal(proposal.tokens, parents, proposal.lookup, proposal.dists)

    def draft_outcomes(
        self,
        pending: bytes,
        roots: Sequence[tuple[int, int]],
        count: int,
        stop: Callable[[], bool],
    ) -> list[OutcomeDraft] | None:
        """Draft ``count`` tokens after each of several outcomes of the pending draft
        ``pending`` (u32 LE), (j, b) each: its first j tokens then token b. When ``stop()``
        says to give up between steps, the drafts hold the tokens made so far. None when the
        engine cannot (the default) or made nothing."""
        return None

    def finish_draft(self, k: int, made: bytes) -> Proposal:
        """The rest of a draft whose first tokens ``made`` (u32 LE, after the committed
        context) were drafted ahead: ``k`` more, as drafting the whole would make them."""
        return self.propose(k, made)

    def adopt_outcome(self, draft: OutcomeDraft) -> None:  # noqa: B027 - optional hook
        """``draft``'s outcome was committed (``extend`` ran): keep the work it cached."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """The stream closed: release what the state holds."""


class ContextState(EngineState):
    """An engine state that keeps the whole committed context as u32 LE bytes."""

    def __init__(self) -> None:
        self.context = bytearray()

    @property
    def length(self) -> int:
        return len(self.context) >> 2

    def extend(self, tokens: bytes) -> None:
        start = len(self.context) >> 2
        self.context += tokens
        self._extended(start)

    def truncate(self, length: int) -> None:
        self._truncating(length)
        del self.context[length * 4 :]

    @abstractmethod
    def _extended(self, start: int) -> None:
        """Tokens from position ``start`` on were appended."""

    @abstractmethod
    def _truncating(self, length: int) -> None:
        """The context is about to be cut back to ``length`` tokens (it still holds them)."""


class DraftEngine(ABC):
    """A named draft model the card can open streams on."""

    name: str
    kind: ModelKind = ModelKind.ENGINE
    vocab_size: int = 0
    """0 for engines that draft any token id (prompt lookup)."""
    tokenizer_sha256: bytes = bytes(32)
    supports_long_context: bool = False
    rank_temperature: float = DEFAULT_RANK_TEMPERATURE
    """The softmax temperature at which the engine's logits rank tree nodes and the outcomes
    drafted ahead for (``sampling.ranking_probs``): its image's, for a model."""

    @abstractmethod
    def open_state(
        self, capacity: int, sampling: Sampling, long_context: bool = False
    ) -> EngineState:
        """A fresh per-stream state for a slot of ``capacity`` tokens."""

    def propose_many(self, jobs: Sequence[tuple[EngineState, int, bytes]]) -> list[Proposal]:
        """Draft for several streams at once (an engine may batch them); by default one by
        one."""
        return [state.propose(k, branch) for state, k, branch in jobs]

    def check_long_context(self, long_context: bool) -> None:
        if long_context and not self.supports_long_context:
            raise InvalidArgumentError(
                f"engine {self.name!r} has no long-context mode; open the stream without it"
            )


def propose_grouped(
    jobs: Sequence[tuple[DraftEngine, EngineState, int, bytes]],
) -> list[Proposal | Exception]:
    """Draft for several streams, one ``propose_many`` per engine, so that an engine batches
    its streams: (engine, state, k, branch) per job; a job whose engine failed gets the
    engine's exception."""
    groups: dict[int, list[int]] = {}
    for i, (engine, *_) in enumerate(jobs):
        groups.setdefault(id(engine), []).append(i)
    out: list[Proposal | Exception] = [Exception("not drafted")] * len(jobs)
    for members in groups.values():
        engine = jobs[members[0]][0]
        results: Sequence[Proposal | Exception]
        try:
            results = engine.propose_many([jobs[i][1:] for i in members])
        except Exception as exc:  # the caller decides: an error reply, or no draft ahead
            results = [exc] * len(members)
        for i, proposal in zip(members, results, strict=True):
            out[i] = proposal
    return out
