"""Choosing a draft's shape, a chain of K tokens or a tree of N nodes, by what it keeps for
what it costs the target.

A pass that scores n positions (the drafted tokens and the one after them) costs the target
``steps(n)`` plain steps; a shape that keeps ``kept`` tokens a pass on average gives
``kept / steps(n)`` tokens per plain step's time, the speed-up a free, instant draft of that
shape would give. The best shape is the one with the most; a tree is chosen only where it
beats every chain.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Shape:
    kind: Literal["chain", "tree"]
    drafted: int
    """Tokens drafted: a chain's length, a tree's nodes."""
    top_k: int = 1
    """Most children a tree node has."""

    def __str__(self) -> str:
        if self.kind == "chain":
            return f"chain of {self.drafted}"
        return f"tree of {self.drafted} (top-{self.top_k})"


def speedup_limit(kept: float, positions: int, steps: Callable[[int], float]) -> float:
    """Tokens a pass keeps over what scoring ``positions`` costs, in plain steps."""
    return kept / steps(positions)


def choose_shape(kept: Mapping[Shape, float], steps: Callable[[int], float]) -> tuple[Shape, float]:
    """(the shape with the most tokens per plain step's time, that figure); on a tie the
    chain, then the smaller draft."""
    if not kept:
        raise ValueError("no shape to choose from")

    def score(shape: Shape) -> tuple[float, int, int]:
        limit = speedup_limit(kept[shape], shape.drafted + 1, steps)
        return limit, shape.kind == "chain", -shape.drafted

    best = max(kept, key=score)
    return best, speedup_limit(kept[best], best.drafted + 1, steps)
