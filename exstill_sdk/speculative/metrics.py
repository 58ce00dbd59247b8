"""Speculative decoding metrics, with vLLM's names and meaning.

- ``num_drafts``: verification rounds that had a draft (of at least one token);
- ``num_draft_tokens``: tokens drafted in them;
- ``num_accepted_tokens``: drafted tokens the target accepted;
- ``num_accepted_tokens_per_pos[i]``: rounds whose draft was accepted at position i (0-based);
- ``num_drafts_per_pos[i]``: rounds whose draft had a token at position i (with adaptive K not
  every draft reaches every position, so acceptance at i is accepted[i] / drafts[i]);
- ``mean_acceptance_length`` = 1 + accepted / drafts: tokens emitted per target pass.

Plus where the time went (waiting on the card, verifying in the target, everything else on the
host), prefetch hits, and how often each K was chosen.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecMetrics:
    max_k: int = 16
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_drafts_per_pos: list[int] = field(default_factory=list)
    rounds: int = 0
    emitted_tokens: int = 0
    prefetch_hits: int = 0
    card_wait_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    k_chosen: Counter[int] = field(default_factory=Counter)
    tree_rounds: int = 0
    """Rounds whose draft was a token tree (counted in ``num_drafts``, its nodes in
    ``num_draft_tokens``, its kept path in ``num_accepted_tokens``; not per position)."""
    shapes_chosen: Counter[str] = field(default_factory=Counter)
    """Rounds per draft shape, when trees were in play ("chain", "tree of N (top-k, depth D)")."""

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.max_k
        if not self.num_drafts_per_pos:
            self.num_drafts_per_pos = [0] * self.max_k

    def record_round(self, k: int, accepted: int, emitted: int, tree: bool = False) -> None:
        """A round with a draft of ``k`` tokens (a tree's nodes, with ``tree``)."""
        self.rounds += 1
        self.emitted_tokens += emitted
        if tree:
            self.tree_rounds += 1
            self.num_drafts += 1
            self.num_draft_tokens += k
            self.num_accepted_tokens += accepted
        elif k:
            self.num_drafts += 1
            self.num_draft_tokens += k
            self.num_accepted_tokens += accepted
            for i in range(accepted):
                self.num_accepted_tokens_per_pos[i] += 1
            for i in range(k):
                self.num_drafts_per_pos[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """The fraction of drafts reaching position i whose token i was accepted (that is,
        with every token before it): 0 where no draft reached i."""
        return [
            a / d if d else 0.0
            for a, d in zip(self.num_accepted_tokens_per_pos, self.num_drafts_per_pos, strict=True)
        ]

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def host_s(self) -> float:
        return max(0.0, self.total_s - self.card_wait_s - self.verify_s)

    def merge(self, other: SpecMetrics) -> None:
        for name in (
            "num_drafts",
            "num_draft_tokens",
            "num_accepted_tokens",
            "rounds",
            "emitted_tokens",
            "prefetch_hits",
            "card_wait_s",
            "verify_s",
            "total_s",
            "tree_rounds",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for i, v in enumerate(other.num_accepted_tokens_per_pos):
            self.num_accepted_tokens_per_pos[i] += v
        for i, v in enumerate(other.num_drafts_per_pos):
            self.num_drafts_per_pos[i] += v
        self.k_chosen.update(other.k_chosen)
        self.shapes_chosen.update(other.shapes_chosen)

    def to_dict(self) -> dict[str, Any]:
        per_pos = self.num_accepted_tokens_per_pos
        last = max((i + 1 for i, v in enumerate(per_pos) if v), default=0)
        drafted = max((i + 1 for i, v in enumerate(self.num_drafts_per_pos) if v), default=0)
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": per_pos[:last],
            "num_drafts_per_pos": self.num_drafts_per_pos[:drafted],
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "rounds": self.rounds,
            "emitted_tokens": self.emitted_tokens,
            "prefetch_hits": self.prefetch_hits,
            "time_s": {
                "card_wait": round(self.card_wait_s, 6),
                "verify": round(self.verify_s, 6),
                "host": round(self.host_s, 6),
                "total": round(self.total_s, 6),
            },
            "k_chosen": dict(sorted(self.k_chosen.items())),
            "tree_rounds": self.tree_rounds,
            "shapes_chosen": dict(self.shapes_chosen.most_common()),
        }
