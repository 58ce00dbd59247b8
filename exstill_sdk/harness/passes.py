"""Timing a target's verification pass by the tokens in it: the one loop behind the demo's
verify curve, the users curve's pass table and the planner's target profiles."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from exstill_sdk.speculative.adapter import TargetAdapter
from exstill_sdk.speculative.trees import TokenTree


def pass_seconds(
    target: Any,
    contexts: Sequence[Sequence[int]],
    drafted: Sequence[int],
    turns: int,
    runs: int = 1,
    warmup: int = 0,
) -> dict[int, list[float]]:
    """Seconds of one pass (``verify_batch``) of every context with K drafted tokens each, for
    each K in ``drafted``: ``turns`` turns through the K (so that a slow moment of the machine
    does not fall on one K), each K run ``warmup`` + ``runs`` times in a row with the first
    ``warmup`` left out (the first pass of a new shape after another is slower, as it never is
    in a decode). The target holds every context but its last token, which each pass scores
    with the draft, as after a round; the sequences are released after."""
    ids = [-100 - i for i in range(len(contexts))]

    def forget_last() -> None:
        for i, c in zip(ids, contexts, strict=True):
            target.rollback(i, len(c) - 1)

    target.verify_batch([(i, c, ()) for i, c in zip(ids, contexts, strict=True)])
    forget_last()
    samples: dict[int, list[float]] = {k: [] for k in drafted}
    for _ in range(turns):
        for k in drafted:
            items = [(i, c, c[-k:] if k else ()) for i, c in zip(ids, contexts, strict=True)]
            for run in range(warmup + runs):
                t0 = time.perf_counter()
                target.verify_batch(items)
                if run >= warmup:
                    samples[k].append(time.perf_counter() - t0)
                forget_last()
    for i in ids:
        target.release(i)
    return samples


def tree_pass_seconds(
    target: Any, context: Sequence[int], tree: Any, keep: Sequence[int], turns: int
) -> tuple[list[float], list[float]]:
    """Seconds of one sequence's pass scoring ``tree`` (a TokenTree after ``context``) and
    then keeping the path ``keep`` of it, as a decoder's tree round takes it; and of its pass
    scoring a chain of as many tokens, the two taken in ``turns`` turns (each twice in a row,
    the first left out, as ``pass_seconds`` times them)."""
    seq = -100
    chain = list(context[-len(tree.tokens) :])

    def second_of_two(score: Callable[[], object]) -> float:
        """Seconds of the second of two passes in a row, the cache back at the context less
        its last token after each (as after a round: the last token to score)."""
        for _ in range(2):
            t0 = time.perf_counter()
            score()
            seconds = time.perf_counter() - t0
            target.rollback(seq, len(context) - 1)
        return seconds

    def tree_round() -> None:
        target.verify_drafts([(seq, context, tree)])
        target.keep_path(seq, tree, keep)

    trees: list[float] = []
    chains: list[float] = []
    try:
        target.verify_batch([(seq, context, ())])
        target.rollback(seq, len(context) - 1)
        for _ in range(turns):
            trees.append(second_of_two(tree_round))
            chains.append(second_of_two(lambda: target.verify_batch([(seq, context, chain)])))
    finally:
        target.release(seq)
    return trees, chains


class Pass(NamedTuple):
    """One verification pass as a decoder ran it."""

    sequences: int
    tokens: int
    """Tokens scored: every sequence's draft (a chain's tokens or a tree's nodes) and one more."""
    tree: bool
    """Whether a draft in it was a tree."""
    seconds: float


class RecordedPasses(TargetAdapter):
    """A target that records each of its steady verification passes as a decoder runs it
    (``passes``), every sequence in it past its first pass (a first pass also takes in the
    prompt). Everything else is the target's own."""

    def __init__(self, target: TargetAdapter) -> None:
        self.target = target
        self.passes: list[Pass] = []
        self._seen: set[int] = set()
        for name in ADAPTER_FIELDS:
            setattr(self, name, getattr(target, name))

    def verify(self, seq_id: int, context: Sequence[int], draft: Sequence[int]) -> Any:
        (logits,) = self._timed(lambda i: [self.target.verify(*i[0])], [(seq_id, context, draft)])
        return logits

    def verify_batch(self, items: Sequence[tuple[int, Sequence[int], Sequence[int]]]) -> Any:
        return self._timed(self.target.verify_batch, items)

    def verify_drafts(self, items: Sequence[tuple[int, Sequence[int], Any]]) -> Any:
        return self._timed(self.target.verify_drafts, items)

    def verify_tree(self, seq_id: int, context: Sequence[int], tree: TokenTree) -> Any:
        (logits,) = self._timed(
            lambda i: [self.target.verify_tree(*i[0])], [(seq_id, context, tree)]
        )
        return logits

    def rollback(self, seq_id: int, length: int) -> None:
        self.target.rollback(seq_id, length)

    def keep_path(self, seq_id: int, tree: TokenTree, nodes: Sequence[int]) -> None:
        self.target.keep_path(seq_id, tree, nodes)

    def release(self, seq_id: int) -> None:
        """The sequence finished: its index is new again (a new decoder numbers its sequences
        from 0, and their first passes take in their prompts)."""
        self._seen.discard(seq_id)
        self.target.release(seq_id)

    def _timed(self, verify: Callable[[Any], Any], items: Sequence[tuple[int, Any, Any]]) -> Any:
        t0 = time.perf_counter()
        out = verify(items)
        seconds = time.perf_counter() - t0
        indices = [i for i, _, _ in items]
        if self._seen.issuperset(indices):
            tree = any(isinstance(draft, TokenTree) for _, _, draft in items)
            tokens = sum(len(getattr(draft, "tokens", draft)) + 1 for _, _, draft in items)
            self.passes.append(Pass(len(items), tokens, tree, seconds))
        self._seen.update(indices)
        return out


ADAPTER_FIELDS = (
    "vocab_size", "eos_token_ids", "max_batch", "max_positions", "supports_trees", "tokenizer"
)  # fmt: skip
"""A ``TargetAdapter``'s attributes (speculative/adapter.py), which a wrapper passes on."""
