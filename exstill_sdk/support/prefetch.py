"""The card's prefetch counters (STATS, docs/protocol.md section 9) gathered for a report."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

BY_LENGTH = "prefetch_hits.accepted_"
PREFIX = "prefetch_"


def prefetch_counts(stats: Mapping[str, int], before: Mapping[str, int]) -> dict[str, int]:
    """The prefetch counters of ``stats`` less those of ``before``: what one run added, to be
    summed with other runs' (Counter) and reported with ``prefetch_report``."""
    return {k: v - before.get(k, 0) for k, v in stats.items() if k.startswith(PREFIX)}


def prefetch_report(stats: Mapping[str, int], before: Mapping[str, int] | None = None) -> dict:
    """Hits (all, on other outcomes than full acceptance, by accepted length), misses, late
    ones and tokens thrown away, counted since ``before`` (an earlier STATS) when given."""
    counts = prefetch_counts(stats, before or {})

    def count(key: str) -> int:
        return counts.get(key, 0)

    hits = count("prefetch_hits")
    rounds = hits + count("prefetch_misses") + count("prefetch_late")
    by_length = {
        key[len(BY_LENGTH) :]: n for key, n in sorted(counts.items()) if key.startswith(BY_LENGTH)
    }
    out: dict[str, Any] = {
        "rounds": rounds,
        "hits": hits,
        "hit_rate": round(hits / rounds, 3) if rounds else 0.0,
        "outcome_hits": count("prefetch_outcome_hits"),
        "outcome_partial": count("prefetch_outcome_partial"),
        "hits_by_accepted": {j: n for j, n in sorted(by_length.items(), key=_num) if n},
        "misses": count("prefetch_misses"),
        "late": count("prefetch_late"),
        "outcomes_late": count("prefetch_outcomes_late"),
        "wasted_tokens": count("prefetch_wasted_tokens"),
    }
    return out


def describe(report: Mapping[str, Any]) -> str:
    """One line: hits of rounds, by accepted length, and the work that missed."""
    line = f"hits {report['hits']}/{report['rounds']}"
    if report["hits_by_accepted"]:
        pairs = ", ".join(f"{j}: {n}" for j, n in report["hits_by_accepted"].items())
        line += f" (by accepted length: {pairs})"
    return line + (
        f", {report['outcome_hits']} on other outcomes than full acceptance, "
        f"{report['outcome_partial']} misses finishing a draft begun ahead; late "
        f"{report['late']} (other outcomes {report['outcomes_late']}), tokens thrown away "
        f"{report['wasted_tokens']}"
    )


def _num(item: tuple[str, int]) -> int:
    return int(item[0])
