"""The tree walk of exstill eval (a chain as a tree: tests/evaluation/test_acceptance.py)."""

from __future__ import annotations

import pytest

from exstill_sdk.errors import InvalidArgumentError
from exstill_sdk.evaluation.trees import check_budgets, tree_passes
from exstill_sdk.speculative.trees import TokenTree


def test_a_branch_keeps_what_the_chain_missed() -> None:
    continuation = [1, 2, 3, 4, 5, 6, 7]
    # at every position: a decoy chain, and a branch from the root holding the next two tokens
    trees = {
        t: TokenTree(
            (9, 9, *continuation[t : t + 2]), (-1, 0, -1, 2)[: 2 + len(continuation[t : t + 2])]
        )
        for t in range(len(continuation))
    }
    # t=0 keeps 1,2 then 3; t=3 keeps 4,5 then 6; t=6 is the last token: the target's own
    assert tree_passes(trees.__getitem__, continuation) == 3
    decoys = {t: TokenTree((9, 9), (-1, 0)) for t in range(len(continuation))}
    assert tree_passes(decoys.__getitem__, continuation) == len(continuation)


def test_budgets_are_checked() -> None:
    assert check_budgets([16, 8, 16]) == (8, 16)
    for bad in ([1], [257]):
        with pytest.raises(InvalidArgumentError, match=r"2\.\.256"):
            check_budgets(bad)
