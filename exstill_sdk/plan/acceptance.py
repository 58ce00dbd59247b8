"""Acceptance: how far into a draft the target agrees with it.

The planner works with ``reach[i]``, the chance that the first i + 1 drafted tokens are all
accepted (vLLM's per-position acceptance: accepted at position i over drafts). It comes from:

- an acceptance profile (TOML or JSON): ``[acceptance] per_position = [...]``, or
  ``mean_length`` at ``at_k`` (then every position is accepted with the same chance a, the
  one that gives that mean length: 1 + a + ... + a^K);
- the JSON of a real run, found anywhere in it: the speculative metrics of ``exstill demo
  --json`` or ``exstill-bench`` (``num_accepted_tokens_per_pos`` with ``num_drafts_per_pos``),
  vLLM's counters (``num_accepted_tokens_per_pos`` with ``num_draft_tokens_per_pos``, as its
  ``SpecDecodingStats`` has them, or with ``num_drafts``), or the fixed-K runs of
  ``exstill-bench e2e`` (mean acceptance length at each K: reach[K - 1] = L(K) - L(K - 1)).

Beyond the positions measured, each further token is accepted with the last position's
chance given the one before it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

from exstill_sdk.plan.profiles import Fields, ProfileError, read_document, resolve


@dataclass(frozen=True)
class Acceptance:
    source: str
    reach: tuple[float, ...]
    """reach[i]: the first i + 1 drafted tokens all accepted."""

    def __post_init__(self) -> None:
        for i, r in enumerate(self.reach):
            if not 0.0 <= r <= 1.0:
                raise ProfileError(
                    f"{self.source}: acceptance at position {i + 1} must be 0..1, not {r:g}"
                )

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


def load_acceptance(path: str | Path) -> Acceptance:
    """An acceptance profile or a run's JSON (module docstring)."""
    p = resolve(path, "acceptance")
    data = read_document(p)
    if "acceptance" in data:
        fields = Fields(p.name, data["acceptance"], "acceptance")
        return _profile(p.name, fields.only("source", "per_position", "mean_length", "at_k"))
    found = _from_run(data)
    if found is None:
        raise ProfileError(
            f"{p.name}: no acceptance in it: give an acceptance profile ([acceptance]) or the "
            "JSON of exstill demo --json, exstill-bench e2e --json or vLLM's spec-decode counters"
        )
    return Acceptance(p.name, found)


def _profile(source: str, a: Fields) -> Acceptance:
    if a.has("per_position"):
        reach = a.numbers("per_position", maximum=1.0)
        if any(b > r + 1e-12 for r, b in pairwise(reach)):
            raise ProfileError(
                f"{source}: acceptance.per_position must not rise: the first i + 1 tokens are "
                "accepted no more often than the first i"
            )
        return Acceptance(source, tuple(reach))
    if not a.has("mean_length"):
        raise ProfileError(f"{source}: acceptance.per_position is missing (or mean_length)")
    k = a.integer("at_k")
    return geometric(source, a.number("mean_length", positive=True), k)


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
