"""A token tree's shape from its parent list (node i's parent < i; -1: the context): what the
host's targets and the card's engines both need to lay a tree out for attention."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def ancestry(parents: Sequence[int]) -> np.ndarray:
    """[N, N] bool: node j is node i or one of its ancestors (parents[i] < i; -1: none)."""
    n = len(parents)
    seen = np.zeros((n, n), bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            seen[i] = seen[parent]
        seen[i, i] = True
    return seen


def depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth: 1 for a child of the context."""
    out: list[int] = []
    for parent in parents:
        out.append(1 if parent < 0 else out[parent] + 1)
    return out
