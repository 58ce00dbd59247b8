"""Acceptance: how far into a draft the target agrees with it.

The planner works with ``reach[i]``, the chance that the first i + 1 drafted tokens are all
accepted (vLLM's per-position acceptance: accepted at position i over drafts). It comes from:

- an acceptance profile (TOML or JSON): ``[acceptance] per_position = [...]``, or
  ``mean_length`` at ``at_k`` (then every position is accepted with the same chance a, the
  one that gives that mean length: 1 + a + ... + a^K);
- an ``exstill eval --json`` report: one draft's acceptance by depth (``report.json#DRAFT``,
  or ``#DRAFT/CATEGORY`` for one kind of prompt; the draft may go unnamed when the report holds
  one model draft), with its ``top_k`` coverage for trees (below);
- the JSON of a real run, found anywhere in it: the speculative metrics of ``exstill demo
  --json`` or ``exstill-bench`` (``num_accepted_tokens_per_pos`` with ``num_drafts_per_pos``),
  vLLM's counters (``num_accepted_tokens_per_pos`` with ``num_draft_tokens_per_pos``, as its
  ``SpecDecodingStats`` has them, or with ``num_drafts``), or the fixed-K runs of
  ``exstill-bench e2e`` (mean acceptance length at each K: reach[K - 1] = L(K) - L(K - 1));
  with the draft's ``top_k`` along the run's text beside them at the top when it was measured
  (``exstill-bench profile`` writes it).

Beyond the positions measured, each further token is accepted with the last position's
chance given the one before it.

Trees, and drafting ahead for other outcomes, need more: where the target refuses the draft's
token, how often its token is the draft's second choice, third, and so on (``rank_share``: the
shares of a position's refusals that each further choice of the draft catches). A profile gives
them as ``top_k`` (the chance that the target's token is among the draft's k likeliest, for k =
1, 2, ...: EAGLE's and Medusa's top-k accuracy; ``exstill eval`` reports it for k = 1..8) or
as one published tree figure, ``tree_mean_length`` for ``tree_nodes`` (the seed's "7.42 for a
tree of 64"): then each further choice catches the same share c of what the ones before it
left, and c is the one that gives that figure (``tree_share``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np

from exstill_sdk.plan.profiles import Fields, ProfileError, read_document, resolve
from exstill_sdk.plan.shapes import tree_shape

RANKS = 8
"""Choices of the draft a position's alternatives are taken from: the first 8 hold all but a
sliver of the refusals the seed's tree figure implies (c = 0.6 leaves 0.4^7 = 0.2%)."""


@dataclass(frozen=True)
class Acceptance:
    source: str
    reach: tuple[float, ...]
    """reach[i]: the first i + 1 drafted tokens all accepted."""
    rank_share: tuple[float, ...] = ()
    """Of a position's refusals, the share the draft's second choice catches, its third, ...
    (module docstring); empty: not known (chains only, and drafting ahead for full
    acceptance only)."""

    def __post_init__(self) -> None:
        for i, r in enumerate(self.reach):
            if not 0.0 <= r <= 1.0:
                raise ProfileError(
                    f"{self.source}: acceptance at position {i + 1} must be 0..1, not {r:g}"
                )
        if any(s < 0 for s in self.rank_share) or sum(self.rank_share) > 1.0 + 1e-9:
            raise ProfileError(
                f"{self.source}: the shares of refusals the draft's further choices catch must "
                f"be 0 or more and add up to at most 1, not {list(self.rank_share)}"
            )

    def ranks(self, position: int) -> list[float]:
        """The chance that the target's token at ``position`` (the context accepted up to
        it) is the draft's first choice, its second, ...: the conditional acceptance, then
        the refusals shared out by ``rank_share``."""
        first = self.conditional(position)
        return [first, *((1.0 - first) * s for s in self.rank_share)]

    def at(self, position: int) -> float:
        """reach[position - 1] for any position from 1, extrapolated past the measured ones."""
        n = len(self.reach)
        if position <= n:
            return self.reach[position - 1]
        last = self.reach[-1]
        ratio = last / self.reach[-2] if n > 1 and self.reach[-2] else last
        return last * ratio ** (position - n)

    def conditional(self, position: int) -> float:
        """Token ``position`` accepted given every one before it was."""
        before = self.at(position - 1) if position > 1 else 1.0
        return self.at(position) / before if before else 0.0

    def mean_length(self, k: int) -> float:
        """Tokens a round emits at K = ``k``: 1 + the expected accepted."""
        return 1.0 + sum(self.at(i) for i in range(1, k + 1))


def geometric(source: str, mean_length: float, k: int) -> Acceptance:
    """Every position accepted with the same chance a, with 1 + a + ... + a^k = mean_length."""
    if not 1.0 <= mean_length <= k + 1:
        raise ProfileError(
            f"{source}: acceptance.mean_length must be 1..{k + 1} at K = {k}, not {mean_length:g}"
        )
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        if sum(a**i for i in range(k + 1)) < mean_length:
            lo = a
        else:
            hi = a
    a = (lo + hi) / 2
    return Acceptance(source, tuple(a**i for i in range(1, k + 1)))


def geometric_shares(c: float) -> tuple[float, ...]:
    """``rank_share`` where each further choice, up to the draft's ``RANKS``-th, catches the
    share c of what the ones before it left."""
    return tuple(c * (1 - c) ** i for i in range(RANKS - 1))


def tree_share(reach: tuple[float, ...], mean_length: float, nodes: int) -> float:
    """The share c (each further choice of the draft catching c of the refusals the ones
    before it left) with which the best tree of ``nodes`` nodes keeps ``mean_length`` tokens a
    pass on top of ``reach``."""

    def length(c: float) -> float:
        return tree_shape(Acceptance("", reach, geometric_shares(c)), nodes).mean_length

    lo, hi = 0.0, 1.0
    if not length(lo) <= mean_length <= length(hi):
        raise ProfileError(
            f"tree_mean_length {mean_length:g} for {nodes} nodes is out of reach of this "
            f"acceptance: {length(lo):.2f} with chains alone, {length(hi):.2f} at most"
        )
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if length(mid) < mean_length else (lo, mid)
    return (lo + hi) / 2


def shares_from_top_k(source: str, top_k: list[float]) -> tuple[float, ...]:
    """``rank_share`` from the chance that the target's token is among the draft's k
    likeliest, k = 1, 2, ..."""
    if any(b < a - 1e-12 for a, b in pairwise(top_k)) or top_k[0] >= 1.0:
        raise ProfileError(
            f"{source}: acceptance.top_k must not fall (the k likeliest hold the k - 1 "
            "likeliest) and its first value must be below 1"
        )
    refused = 1.0 - top_k[0]
    return tuple(max(0.0, b - a) / refused for a, b in pairwise(top_k))


ACCEPTANCE_FIELDS = (
    "source",
    "per_position",
    "mean_length",
    "at_k",
    "top_k",
    "tree_mean_length",
    "tree_nodes",
)


def load_acceptance(path: str | Path) -> Acceptance:
    """An acceptance profile, a run's JSON or an ``exstill eval --json`` report, whose draft
    and prompt category ``path`` may name after a ``#`` (module docstring)."""
    file, pick = (str(path), "") if Path(path).exists() else str(path).partition("#")[::2]
    p = resolve(file, "acceptance")
    data = read_document(p)
    if isinstance(data, dict) and isinstance(data.get("drafters"), dict):
        return _from_eval(p.name, data["drafters"], pick)
    if pick:
        raise ProfileError(
            f"{p.name}: '#{pick}' names a draft of an exstill eval report; this file is not one"
        )
    if "acceptance" in data:
        fields = Fields(p.name, data["acceptance"], "acceptance")
        return _profile(p.name, fields.only(*ACCEPTANCE_FIELDS))
    found = _from_run(data)
    if found is None:
        raise ProfileError(
            f"{p.name}: no acceptance in it: give an acceptance profile ([acceptance]) or the "
            "JSON of exstill demo --json, exstill-bench e2e --json or vLLM's spec-decode counters"
        )
    top_k = data.get("top_k") if isinstance(data, dict) else None  # the draft's, beside a run
    return with_top_k(Acceptance(p.name, found), top_k)


def with_top_k(acceptance: Acceptance, top_k: Any) -> Acceptance:
    """``acceptance`` with the rank shares of its draft's ``top_k`` (none given, or a draft
    never refused, top-1 of 1: no refusals to share out, and it stays as it is)."""
    if top_k is None:
        return acceptance
    if not (
        isinstance(top_k, list)
        and top_k
        and all(isinstance(v, (int, float)) and 0.0 <= v <= 1.0 for v in top_k)
    ):
        raise ProfileError(
            f"{acceptance.source}: top_k must be a list of chances 0..1 (the target's token "
            f"among the draft's k likeliest, k = 1, 2, ...), not {top_k!r}"
        )
    if top_k[0] == 1.0:
        return acceptance
    return replace(acceptance, rank_share=shares_from_top_k(acceptance.source, top_k))


def _profile(source: str, a: Fields) -> Acceptance:
    if a.has("per_position"):
        reach = a.numbers("per_position", maximum=1.0)
        if any(b > r + 1e-12 for r, b in pairwise(reach)):
            raise ProfileError(
                f"{source}: acceptance.per_position must not rise: the first i + 1 tokens are "
                "accepted no more often than the first i"
            )
        chains = Acceptance(source, tuple(reach))
    elif not a.has("mean_length"):
        raise ProfileError(f"{source}: acceptance.per_position is missing (or mean_length)")
    else:
        chains = geometric(source, a.number("mean_length", positive=True), a.integer("at_k"))
    if a.has("top_k") and a.has("tree_mean_length"):
        raise ProfileError(f"{source}: give acceptance.top_k or tree_mean_length, not both")
    if a.has("top_k"):
        top_k = a.numbers("top_k", maximum=1.0)
        return replace(chains, rank_share=shares_from_top_k(source, top_k))
    if a.has("tree_mean_length"):
        nodes = a.integer("tree_nodes")
        try:
            c = tree_share(chains.reach, a.number("tree_mean_length", positive=True), nodes)
        except ProfileError as exc:
            raise ProfileError(f"{source}: acceptance.{exc}") from None
        return replace(chains, rank_share=geometric_shares(c))
    return chains


def _from_eval(source: str, drafters: dict[str, Any], pick: str) -> Acceptance:
    """One draft's acceptance in an ``exstill eval`` report, over all its prompts or one
    category's (``pick``: ``DRAFT`` or ``DRAFT/CATEGORY``; none: the report's one model draft):
    reach from its acceptance by depth, rank shares from its ``top_k``."""
    name, _, category = pick.partition("/")
    if not name:
        models = [d for d, groups in drafters.items() if "top_k" in groups.get("all", {})]
        if len(models) != 1:
            raise ProfileError(
                f"{source} holds the drafts {', '.join(drafters)}: name one, as "
                f"{source}#DRAFT (or {source}#DRAFT/CATEGORY for one kind of prompt)"
            )
        name = models[0]
    if name not in drafters:
        raise ProfileError(f"{source} has no draft {name!r}: it has {', '.join(drafters)}")
    groups = drafters[name]
    row = groups.get(category or "all")
    if not isinstance(row, dict) or "acceptance_by_depth" not in row:
        raise ProfileError(
            f"{source}: draft {name!r} has no category {category!r}: it has {', '.join(groups)}"
        )
    reach = tuple(float(r) for r in np.cumprod(row["acceptance_by_depth"]))
    where = f"{source}#{name}/{category or 'all'}"
    return with_top_k(Acceptance(where, reach), row.get("top_k"))  # none: prompt lookup


def _from_run(data: Any) -> tuple[float, ...] | None:
    for table in _tables(data):
        shown = table.get("acceptance_per_position")  # exstill demo --json
        if isinstance(shown, list) and all(isinstance(v, (int, float)) for v in shown):
            while shown and not shown[-1]:  # positions no draft reached
                shown = shown[:-1]
            if shown:
                return tuple(_non_rising([max(0.0, min(1.0, float(v))) for v in shown]))
        per_pos = table.get("num_accepted_tokens_per_pos")
        if isinstance(per_pos, list) and per_pos:
            drafts = table.get("num_drafts_per_pos", table.get("num_draft_tokens_per_pos"))
            if not isinstance(drafts, list):
                n = table.get("num_drafts")
                drafts = [n] * len(per_pos) if isinstance(n, int) else None
            if drafts:
                reach = [a / d for a, d in zip(per_pos, drafts, strict=False) if d]
                return tuple(_non_rising(reach)) if reach else None
        fixed = table.get("fixed_k")
        if isinstance(fixed, dict) and "1" in fixed:
            lengths = {int(k): v.get("mean_acceptance_length") for k, v in fixed.items()}
            reach, previous = [], 1.0
            for k in range(1, max(lengths) + 1):
                if not isinstance(lengths.get(k), (int, float)):
                    break
                reach.append(max(0.0, min(1.0, lengths[k] - previous)))
                previous = lengths[k]
            if reach:
                return tuple(_non_rising(reach))
    return None


def _non_rising(values: list[float]) -> list[float]:
    """Measured per-position rates, capped so that none rises above the one before (a longer
    prefix is never accepted more often; a rise is noise)."""
    out: list[float] = []
    for v in values:
        out.append(min(v, out[-1]) if out else v)
    return out


def _tables(data: Any) -> Iterator[dict[str, Any]]:
    """Every dict in ``data``, outermost first."""
    queue = [data]
    while queue:
        item = queue.pop(0)
        if isinstance(item, dict):
            yield item
            queue.extend(item.values())
        elif isinstance(item, list):
            queue.extend(v for v in item if isinstance(v, (dict, list)))
