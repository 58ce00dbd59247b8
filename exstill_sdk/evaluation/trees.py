"""Token trees in ``exstill eval``: tokens kept per pass when every pass verifies the tree the
card grows, against a chain at equal verified tokens.

A budget N is the positions one pass of the target scores: N - 1 drafted tokens as a chain, or
a tree of N - 1 nodes. The tree is the card's own (the firmware's transformer engine on the
draft image, EAGLE-2's levels: ``top_k`` children a node, as deep as N - 1), grown at each pass
from the target's text so far; greedy verification keeps its longest path that the target's
own continuation agrees with, and one token more. Unlike a chain, a tree cannot be scored from
one teacher-forced pass (its branches leave the target's text), so the walk drafts every
pass's tree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from exstill_firmware.engines.base import Sampling
from exstill_firmware.engines.transformer import TransformerEngine

from exstill_sdk.errors import InvalidArgumentError
from exstill_sdk.image.reader import CardImage
from exstill_sdk.protocol.messages import (
    TreeRequest,
    decode_tokens,
    encode_tokens,
    parents_from_wire,
)
from exstill_sdk.speculative.trees import TokenTree, greedy_path

TREE_TOP_KS = (2, 4, 8)
"""The card's trees measured at each budget: children a node."""
MAX_BUDGET = 256
"""A tree request's nodes travel in one byte (protocol/messages.py)."""


def check_budgets(budgets: Sequence[int]) -> tuple[int, ...]:
    """The budgets, sorted and once each; InvalidArgumentError for one out of 2..256."""
    for n in budgets:
        if not 2 <= n <= MAX_BUDGET:
            raise InvalidArgumentError(
                f"--trees budgets must be 2..{MAX_BUDGET} positions a pass, not {n}"
            )
    return tuple(sorted(set(budgets)))


def tree_passes(tree_at: Callable[[int], TokenTree], continuation: Sequence[int]) -> int:
    """Verification passes that produce ``continuation`` when the pass at position t verifies
    ``tree_at(t)`` greedily: it keeps the tree's path the continuation agrees with and the
    target's token after it."""
    t = passes = 0
    while t < len(continuation):
        t += len(greedy_path(tree_at(t), continuation[t:])) + 1
        passes += 1
    return passes


class CardTrees:
    """The card's transformer engine on a draft image, growing trees along a text."""

    def __init__(self, image: CardImage, positions: int) -> None:
        self.engine = TransformerEngine(image, rows=1, positions=max(positions, 16), threads=1)

    def passes(
        self, prompt: Sequence[int], continuation: Sequence[int], budget: int, top_k: int
    ) -> int:
        """``tree_passes`` with the tree of ``budget - 1`` nodes, ``top_k`` children a node,
        that the card grows after the prompt and the continuation's first t tokens."""
        state = self.engine.open_state(self.engine.positions, Sampling())
        shape = TreeRequest(budget - 1, top_k, budget - 1)
        state.extend(encode_tokens(list(prompt)))
        fed = 0

        def tree_at(t: int) -> TokenTree:
            nonlocal fed
            if t > fed:
                state.extend(encode_tokens(list(continuation[fed:t])))
                fed = t
            made = state.propose_tree(shape)
            return TokenTree(decode_tokens(made.tokens), parents_from_wire(made.parents))

        try:
            return tree_passes(tree_at, continuation)
        finally:
            state.close()
