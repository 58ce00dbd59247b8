"""Choosing a draft's shape, a chain of K tokens or a tree of N nodes, by what it keeps for
what it costs the target.

A pass that scores n positions (the drafted tokens and the one after them) costs the target
``steps(n)`` plain steps; a shape that keeps ``kept`` tokens a pass on average gives
``kept / steps(n)`` tokens per plain step's time, the speed-up a free, instant draft of that
shape would give. The best shape is the one with the most; a tree is chosen only where it
beats every chain.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from exstill_sdk.protocol.messages import TreeRequest


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


MAX_BACKOFF = 4
"""A tree that keeps losing is still probed in one sequence of 16."""


class TreeChooser:
    """Which shape one sequence's next round drafts: the chain (of the K its policy chooses)
    or one of the candidate trees, by the tokens a second each has given in its latest rounds.

    A tree's worth cannot be read off the chain's rounds (the card sends the tokens it drafted,
    not how the target ranked the others), and what a tree round costs is not a chain round's:
    the card drafts it level by level while the target waits (a chain is drafted ahead during
    the target's pass) and the target scores it alone. So each shape is measured where it runs,
    in the sequence at hand: what a shape keeps is the text's, and a chain that keeps 16 tokens
    a round in one text says nothing of the next. Each sequence starts with ``warmup``
    chain rounds, and a tree is tried only while it could keep more than the sequence's latest
    chain rounds did (its depth + 1 above their mean: a chain the target takes whole leaves a
    tree nothing to win); a tree round that keeps its whole depth sends the next round back to
    the chain, to see whether the text has become one a chain takes whole. Each tree so
    eligible gets ``probe`` rounds, then the best by tokens a second runs, and every
    ``reprobe`` rounds the shape measured longest ago gets one round, so that a change in the
    load is seen. A tree must beat the chain by ``margin`` to be chosen. ``fixed``: the one
    candidate every round (a benchmark's fixed shape).

    The chain a tree must beat is the steady chain: only chain rounds that follow a chain
    round count towards its rate (the first chain round after a tree finds no draft made
    ahead, which says nothing of staying on the chain), and where the K policy expects more
    of the chain at the K it would settle on (``choose(chain_rate=...)``), that counts. With
    the target's verification time by tokens too (``verify_s``), a tree is not even tried
    where keeping its whole depth in the time its pass alone takes, or in the shortest round of
    it seen so far (in any sequence: the card drafts a tree while the target waits, and the
    round after it finds no draft made ahead), would not beat that rate by ``margin``: each
    probe of a tree that cannot win costs a round. For the same reason a
    tree probed in a sequence and never chosen there rests the next sequence, then (losing
    again) the next 3, 7, ... up to ``2 ** MAX_BACKOFF - 1``, until it wins once.
    """

    def __init__(
        self,
        candidates: Sequence[TreeRequest],
        probe: int = 2,
        window: int = 16,
        warmup: int = 6,
        reprobe: int = 32,
        margin: float = 1.1,
        fixed: bool = False,
    ) -> None:
        if fixed and len(candidates) != 1:
            raise ValueError("a fixed shape is one candidate")
        self.fixed = fixed
        self.arms: list[TreeRequest | None] = [None, *candidates]
        self.probe = probe
        self.warmup = warmup
        self.reprobe = reprobe
        self.margin = margin
        self._seen: dict[int, deque[tuple[int, float]]] = {
            i: deque(maxlen=window) for i in range(len(self.arms))
        }
        self._last: dict[int, int] = {}
        self._rounds = 0
        self._chain_kept: deque[int] = deque(maxlen=warmup)
        """Tokens of the sequence's latest chain rounds."""
        self._back_to_chain = False
        self._prev: int | None = None
        """The arm of the sequence's last round observed."""
        self._lost = dict.fromkeys(range(1, len(self.arms)), 0)
        """Per tree: the sequences in a row it was probed in and not chosen."""
        self._rest = dict.fromkeys(range(1, len(self.arms)), 0)
        """Per tree: the sequences it is still not probed in."""
        self._won: set[int] = set()
        """The trees chosen in the sequence so far."""
        self._resting: set[int] = set()
        """The trees not probed in this sequence (they lost lately)."""
        self._fastest: dict[int, float] = {}
        """Per tree: the shortest round of it seen, kept across sequences: what a round of it
        costs at the least (its pass, and the card drafting it while the target waits)."""

    def start(self) -> None:
        """A new sequence: its text decides again whether a tree can win, and by how much."""
        for arm in self._lost:
            if arm in self._won:
                self._lost[arm] = self._rest[arm] = 0
            elif self._seen[arm]:  # probed and never chosen: rest 1, 3, 7, ... sequences
                self._lost[arm] += 1
                self._rest[arm] = 2 ** min(self._lost[arm], MAX_BACKOFF) - 1
        self._won.clear()
        self._resting = {arm for arm, rest in self._rest.items() if rest}
        for arm in self._resting:
            self._rest[arm] -= 1
        for seen in self._seen.values():
            seen.clear()
        self._chain_kept.clear()
        self._back_to_chain = False
        self._prev = None

    def rate(self, arm: int) -> float | None:
        """Tokens a second in the arm's latest rounds: their tokens over their seconds (what
        a run of them gives; a median of each round's own rate would favour the shape whose
        tokens a round vary less, since a round keeps 1 token or many); None before any."""
        seen = self._seen[arm]
        seconds = sum(s for _, s in seen)
        return sum(t for t, _ in seen) / seconds if seconds > 0 else None

    def _depth(self, arm: int) -> int:
        shape = self.arms[arm]
        assert shape is not None
        return shape.levels

    def _eligible(
        self, chain_rate: float | None, verify_s: Callable[[int], float | None] | None
    ) -> list[int]:
        """The trees that could keep more a round than the sequence's chain rounds did, and
        could beat the chain's expected rate if they kept their whole depth."""
        kept = sum(self._chain_kept) / len(self._chain_kept)
        out = []
        for arm in range(1, len(self.arms)):
            shape = self.arms[arm]
            assert shape is not None
            if shape.levels + 1 <= kept or arm in self._resting:
                continue
            if chain_rate:
                # a pass of the tree alone, or the shortest round of it seen, the longer
                seconds = max(
                    (verify_s(shape.nodes + 1) if verify_s else None) or 0.0,
                    self._fastest.get(arm, 0.0),
                )
                if seconds and (shape.levels + 1) / seconds <= chain_rate * self.margin:
                    continue
            out.append(arm)
        return out

    def choose(
        self,
        chain_rate: float | None = None,
        verify_s: Callable[[int], float | None] | None = None,
    ) -> int:
        """The arm (index into ``arms``; 0 the chain) of the next round; ``chain_rate``: the
        tokens a second the K policy expects of the chain at its best K, and ``verify_s``: the
        seconds a pass of n tokens takes, if the policy knows."""
        self._rounds += 1
        if self.fixed:
            return 1
        if len(self._chain_kept) < self.warmup or self._back_to_chain:
            self._back_to_chain = False
            return 0
        trees = self._eligible(chain_rate, verify_s)
        for arm in trees:
            if len(self._seen[arm]) < self.probe:
                return arm
        if self._rounds % self.reprobe == 0:
            return min([0, *trees], key=lambda arm: self._last.get(arm, -1))
        return self.best(trees, chain_rate)

    def best(self, trees: list[int], chain_rate: float | None = None) -> int:
        rates = {arm: self.rate(arm) or 0.0 for arm in [0, *trees]}
        rates[0] = max(rates[0], chain_rate or 0.0)
        tree = max(trees, key=lambda arm: rates[arm], default=0)
        if tree and rates[tree] > rates[0] * self.margin:
            self._won.add(tree)
            return tree
        return 0

    def observe(self, arm: int, tokens: int, seconds: float) -> None:
        """A round of ``arm`` gave ``tokens`` tokens in ``seconds`` (its pass, its card
        work and the host's round)."""
        if arm:
            self._fastest[arm] = min(seconds, self._fastest.get(arm, seconds))
        steady = arm != 0 or self._prev == 0
        self._prev = arm
        if steady:
            self._seen[arm].append((tokens, seconds))
        self._last[arm] = self._rounds
        if arm == 0:
            self._chain_kept.append(tokens)
        elif tokens > self._depth(arm):
            self._back_to_chain = True

    def describe(self, arm: int) -> str:
        shape = self.arms[arm]
        if shape is None:
            return "chain"
        return f"tree of {shape.nodes} (top-{shape.top_k}, depth {shape.depth})"
