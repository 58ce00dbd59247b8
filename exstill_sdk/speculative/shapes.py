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
from exstill_sdk.speculative.adaptive import ChainRound


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
GAIN_PRIOR = 1.3
"""Tokens a tree round keeps over the chain inside it, before its rounds say: above the 16-21%
published for trees over chains of as many verified tokens (a tree's inside chain is shorter
than such a chain), so that a tree is probed wherever it might win."""
GAIN_PRIOR_TOKENS = 8
"""What the prior is worth: as many of the inside chain's tokens (two to four rounds)."""
GAIN_WINDOW = 64
"""Tree rounds its gain is measured over."""


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

    A tree round also tells what the chain would have kept in its place: the chain inside the
    tree (each node's first child, as deep as the tree) is the chain the card drafts, so a
    chain of K would have kept min(its kept tokens, K) + 1 tokens there (``observe(...,
    chain_kept=...)``). With the seconds of a steady chain round at each K
    (``choose(chain_rounds=...)``, the K policy's), a tree is judged against the best chain on
    its own rounds, the same stretch of text: judged against chain rounds run before it, a
    tree that ran where the text grew easier looked better than the chain it replaced (on the
    demo prompt it was chosen for 20 rounds and lost 10% there). Without those, the chain a
    tree must beat is the steady chain: only chain rounds that follow a chain
    round count towards its rate (the first chain round after a tree finds no draft made
    ahead, which says nothing of staying on the chain), and where the K policy expects more
    of the chain at the K it would settle on (``choose(chain_rate=...)``), that counts. With
    the target's verification time by tokens too (``verify_s``), a tree is not even tried
    where keeping its whole depth in the time its pass alone takes, or in the shortest round of
    it seen so far (in any sequence: the card drafts a tree while the target waits, and the
    round after it finds no draft made ahead), would not beat that rate by ``margin``: each
    probe of a tree that cannot win costs a round. For the same reason a
    tree probed in a sequence and never chosen there rests the next sequence, then (losing
    again) the next 3, 7, ... up to ``2 ** MAX_BACKOFF - 1``, until it wins once. A tree's
    first round is not timed: it may pay for building the target's tree path.
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
        self._seen: dict[int, deque[tuple[int, float, int | None]]] = {
            i: deque(maxlen=window) for i in range(len(self.arms))
        }
        """Per arm: its latest steady rounds' tokens, seconds and (a tree's) chain kept."""
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
        self._gains: dict[int, deque[tuple[int, int]]] = {
            arm: deque(maxlen=GAIN_WINDOW) for arm in range(1, len(self.arms))
        }
        """Per tree: its latest rounds in any sequence, the tokens kept and those the chain
        inside kept (with the target's token after them)."""

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
        seconds = sum(s for _, s, _ in seen)
        return sum(t for t, _, _ in seen) / seconds if seconds > 0 else None

    def chain_on_rounds_of(self, arm: int, chain_rounds: Sequence[ChainRound]) -> float | None:
        """Tokens a second the best chain (K from 0 to the tree's depth) would have given on
        the tree's latest rounds, from what the chain inside each kept and what a steady chain
        round takes by K; None before a round that tells it."""
        kept = [c for _, _, c in self._seen[arm] if c is not None]
        if not kept:
            return None
        ks = range(min(self._depth(arm), len(chain_rounds) - 1) + 1)
        return max(
            (
                sum(min(c, k) + 1 for c in kept) / (len(kept) * chain_rounds[k].seconds)
                for k in ks
                if chain_rounds[k].seconds > 0
            ),
            default=None,
        )

    def gain(self, arm: int) -> float:
        """Tokens a round of the tree keeps over those the chain inside it keeps, over its
        rounds in every sequence so far, joined by ``GAIN_PRIOR``."""
        tree = sum(t for t, _ in self._gains[arm]) + GAIN_PRIOR * GAIN_PRIOR_TOKENS
        return tree / (sum(c for _, c in self._gains[arm]) + GAIN_PRIOR_TOKENS)

    def _depth(self, arm: int) -> int:
        shape = self.arms[arm]
        assert shape is not None
        return shape.levels

    def _eligible(
        self,
        chain_rate: float | None,
        verify_s: Callable[[int], float | None] | None,
        chain_rounds: Sequence[ChainRound] | None,
    ) -> list[int]:
        """The trees not resting that could keep more a round than the sequence's chain rounds
        did, and could beat the chain's expected rate (``could_win``)."""
        kept = sum(self._chain_kept) / len(self._chain_kept)
        return [
            arm
            for arm in range(1, len(self.arms))
            if self._depth(arm) + 1 > kept
            and arm not in self._resting
            and self.could_win(arm, chain_rate, verify_s, chain_rounds)
        ]

    def could_win(
        self,
        arm: int,
        chain_rate: float | None,
        verify_s: Callable[[int], float | None] | None = None,
        chain_rounds: Sequence[ChainRound] | None = None,
    ) -> bool:
        """Whether the tree could beat the chain's expected rate by ``margin``: keeping its
        whole depth, or (where the policy expects a chain of its depth to keep less) that
        chain's tokens times the tree's gain, in a pass of it alone or its shortest round seen
        (the longer); True where the rate or the time is unknown."""
        if not chain_rate:
            return True
        shape = self.arms[arm]
        assert shape is not None
        seconds = max(
            (verify_s(shape.nodes + 1) if verify_s else None) or 0.0,
            self._fastest.get(arm, 0.0),
        )
        if not seconds:
            return True
        most = float(shape.levels + 1)
        if chain_rounds is not None and shape.levels < len(chain_rounds):
            most = min(most, self.gain(arm) * chain_rounds[shape.levels].tokens)
        return most / seconds > chain_rate * self.margin

    def choose(
        self,
        chain_rate: float | None = None,
        verify_s: Callable[[int], float | None] | None = None,
        chain_rounds: Sequence[ChainRound] | None = None,
    ) -> int:
        """The arm (index into ``arms``; 0 the chain) of the next round; ``chain_rate``: the
        tokens a second the K policy expects of the chain at its best K, ``verify_s``: the
        seconds a pass of n tokens takes, and ``chain_rounds``: what a steady chain round
        gives and takes by K, if the policy knows."""
        self._rounds += 1
        if self.fixed:
            return 1
        if len(self._chain_kept) < self.warmup or self._back_to_chain:
            self._back_to_chain = False
            return 0
        trees = self._eligible(chain_rate, verify_s, chain_rounds)
        for arm in trees:
            if len(self._seen[arm]) < self.probe:
                return arm
        if self._rounds % self.reprobe == 0:
            return min([0, *trees], key=lambda arm: self._last.get(arm, -1))
        return self.best(trees, chain_rate, chain_rounds)

    def best(
        self,
        trees: list[int],
        chain_rate: float | None = None,
        chain_rounds: Sequence[ChainRound] | None = None,
    ) -> int:
        """The tree with the most tokens a second of those beating by ``margin`` the chain on
        their own rounds (where ``chain_rounds`` tells a chain round's cost), else the chain's
        rate; 0 (the chain) where none does."""
        steady = max(self.rate(0) or 0.0, chain_rate or 0.0)
        winners = []
        for arm in trees:
            rate = self.rate(arm) or 0.0
            paired = self.chain_on_rounds_of(arm, chain_rounds) if chain_rounds else None
            if rate > (steady if paired is None else paired) * self.margin:
                winners.append((rate, arm))
        if winners:
            tree = max(winners)[1]
            self._won.add(tree)
            return tree
        return 0

    def observe(self, arm: int, tokens: int, seconds: float, chain_kept: int | None = None) -> None:
        """A round of ``arm`` gave ``tokens`` tokens in ``seconds`` (its pass, its card
        work and the host's round); ``chain_kept``: of a tree round, the drafted tokens the
        chain inside the tree kept."""
        # A tree's first round is not timed: the first tree round of a process pays for the
        # target's tree path (``OnnxTarget`` builds its tree session on the first tree it
        # scores: 637 ms against 27 for the next pass, on the large demo target). Timed, that
        # round made the tree look unable to win, and it was never probed again.
        cold = arm != 0 and arm not in self._last
        if arm and not cold:
            self._fastest[arm] = min(seconds, self._fastest.get(arm, seconds))
        if arm and chain_kept is not None:
            self._gains[arm].append((tokens, chain_kept + 1))
        steady = not cold and (arm != 0 or self._prev == 0)
        self._prev = arm
        if steady:
            self._seen[arm].append((tokens, seconds, chain_kept if arm else None))
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
