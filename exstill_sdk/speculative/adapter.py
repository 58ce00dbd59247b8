"""TargetAdapter: the one interface a target model implements (docs/integrating-a-target.md).

The decoder owns everything else (acceptance, sampling, K, metrics, the card). A target only
scores drafts and forgets what was rejected:

- ``verify(seq_id, context, draft)``: the target's logits [len(draft) + 1, vocab] for the
  positions that predict draft[0], draft[1], ..., and the token after the whole draft, given the
  accepted ``context`` (prompt and every accepted token so far). A target keeps a cache per
  sequence and only computes what it has not seen.
- ``rollback(seq_id, length)``: only the first ``length`` tokens of context + draft were
  accepted; drop the rest from the cache.
- ``release(seq_id)``: the sequence finished.

A target that scores token trees in one pass (``supports_trees``) also implements
``verify_tree`` and ``keep_path``; for the others the decoder drafts chains. A round with
trees in it goes through ``verify_drafts``: chains and trees of several sequences, in one pass
where the target can (``OnnxTarget``), else the chains batched and each tree alone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np

from exstill_sdk.image.tokenizer import TokenizerFingerprint
from exstill_sdk.speculative.trees import TokenTree


class TargetAdapter(ABC):
    vocab_size: int
    """Width of the logits the target returns."""
    eos_token_ids: tuple[int, ...] = ()
    """Tokens that end a sequence (the decoder stops after emitting one)."""
    max_batch: int = 0
    """How many sequences the target can hold at once; sequences the card has no stream for
    then run with the target alone (K = 0) until one frees. 0: unknown, so they wait for a
    stream instead."""
    max_positions: int = 0
    """The longest sequence the target holds (a model's ``max_position_embeddings``, an
    engine's cache); the decoder refuses a request that would pass it, whatever the card's slot.
    0: unknown."""
    supports_trees: bool = False
    """``verify_tree`` and ``keep_path`` work: a token tree is scored in one pass."""
    tokenizer: TokenizerFingerprint | None = None
    """The target's tokenizer identity; a card stream on an image made for another tokenizer
    is refused. None skips the hash check (the vocabulary size is still compared)."""

    @abstractmethod
    def verify(self, seq_id: int, context: Sequence[int], draft: Sequence[int]) -> np.ndarray:
        """Logits [len(draft) + 1, vocab_size] after context, context + draft[:1], ..."""

    @abstractmethod
    def rollback(self, seq_id: int, length: int) -> None:
        """Keep the first ``length`` tokens of the sequence's cache."""

    def verify_batch(
        self, items: Sequence[tuple[int, Sequence[int], Sequence[int]]]
    ) -> list[np.ndarray]:
        """Several sequences at once; a target that can batch overrides this."""
        return [self.verify(seq_id, context, draft) for seq_id, context, draft in items]

    def verify_tree(self, seq_id: int, context: Sequence[int], tree: TokenTree) -> np.ndarray:
        """Logits [len(tree) + 1, vocab_size]: after the context, then after the context
        followed by each node's path. Leaves the cache holding the context (``keep_path``
        adds a path to it)."""
        raise NotImplementedError(f"{type(self).__name__} does not score token trees")

    def verify_drafts(
        self, items: Sequence[tuple[int, Sequence[int], Sequence[int] | TokenTree]]
    ) -> list[np.ndarray]:
        """Several sequences' chains and trees: each one's ``verify`` or ``verify_tree``
        logits. By default the chains in one ``verify_batch`` and each tree in a pass of its
        own; a target that scores them all in one pass overrides this."""
        out: dict[int, np.ndarray] = {}
        chains: list[int] = []
        batch: list[tuple[int, Sequence[int], Sequence[int]]] = []
        for i, (seq_id, context, draft) in enumerate(items):
            if not isinstance(draft, TokenTree):
                chains.append(i)
                batch.append((seq_id, context, draft))
        if batch:
            out = dict(zip(chains, self.verify_batch(batch), strict=True))
        for i, (seq_id, context, draft) in enumerate(items):
            if isinstance(draft, TokenTree):
                out[i] = self.verify_tree(seq_id, context, draft)
        return [out[i] for i in range(len(items))]

    def keep_path(self, seq_id: int, tree: TokenTree, nodes: Sequence[int]) -> None:
        """After ``verify_tree``: the cache holds the context followed by the tokens of
        ``nodes``, a path of ``tree`` from the context."""
        raise NotImplementedError(f"{type(self).__name__} does not score token trees")

    def release(self, seq_id: int) -> None:  # noqa: B027 - optional hook
        """The sequence finished; free its cache."""
